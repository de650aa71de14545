#!/usr/bin/env python3
"""lm-eval tasks built from held-out text, for crosskv.lm_eval offline (YAML + JSONL in one folder):

    ckv_cloze       4-way continuation choice: a passage of --context words, then its true next --choice words
                    against those of three other passages (chance 0.25); acc and acc_norm
    ckv_recall      4-way span recall: the passage, then "Earlier the text said:" and one of its own word spans
                    against spans of three other passages; needs the passage's exact content (chance 0.25)
    ckv_ppl         rolling log-likelihood of each passage (word perplexity, bits per byte)

    python3 tools/family/local_tasks.py --text held.jsonl --out tasks [--n 200 --seed 0]
    .venv-lmeval/bin/python -m crosskv.lm_eval --model_args source=S,target=T,mapper=M,mode=mapped \\
        --tasks ckv_cloze,ckv_recall,ckv_ppl --include_path tasks --output_path results/mapped

Passages are drawn (seeded) from the text's documents, one per draw, so the three distractors come from elsewhere.
"""
import argparse
import json
import os

import numpy as np

COMMON = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
CHOICE = ("output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
          "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def passages(path, n, words, seed):
    docs = [json.loads(line)["text"] if path.endswith(".jsonl") else line for line in open(path)]
    split = [d.split() for d in docs if len(d.split()) > words]
    if not split:
        raise SystemExit(f"{path}: no document holds more than {words} words")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        d = split[rng.integers(len(split))]
        s = int(rng.integers(0, len(d) - words))
        out.append(d[s: s + words])
    return out, rng


def records(ps, rng, context, choice, span):
    rows = []
    for i, p in enumerate(ps):
        others = [ps[j] for j in rng.choice([j for j in range(len(ps)) if j != i], 3, replace=False)]
        order = rng.permutation(4)
        conts = [" " + " ".join(x[context: context + choice]) for x in [p] + others]
        s = int(rng.integers(0, context - span))
        spans = [" " + " ".join(x[s: s + span]) for x in [p] + others]
        ctx = " ".join(p[:context])
        rows.append({"context": ctx, "choices": [conts[k] for k in order], "label": int(np.argmax(order == 0)),
                     "recall_context": ctx + "\nEarlier the text said:", "spans": [spans[k] for k in order],
                     "text": " ".join(p[: context + choice])})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="held-out text (.txt, a document a line, or .jsonl with text)")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=200, help="documents per task")
    p.add_argument("--context", type=int, default=96, help="words of context")
    p.add_argument("--choice", type=int, default=12, help="words of each continuation")
    p.add_argument("--span", type=int, default=8, help="words of each recalled span")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ps, rng = passages(a.text, a.n, a.context + a.choice, a.seed)
    data = os.path.abspath(os.path.join(a.out, "data.jsonl"))
    with open(data, "w") as f:
        for r in records(ps, rng, a.context, a.choice, a.span):
            f.write(json.dumps(r) + "\n")
    common = COMMON.format(data=data)
    with open(os.path.join(a.out, "ckv_cloze.yaml"), "w") as f:
        f.write("task: ckv_cloze\n" + common + CHOICE)
    with open(os.path.join(a.out, "ckv_recall.yaml"), "w") as f:
        f.write("task: ckv_recall\n" + common + CHOICE.replace("{{context}}", "{{recall_context}}")
                .replace("{{choices}}", "{{spans}}"))
    with open(os.path.join(a.out, "ckv_ppl.yaml"), "w") as f:
        f.write("task: ckv_ppl\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    print(f"{len(ps)} documents: {a.out}/ckv_cloze.yaml, ckv_recall.yaml, ckv_ppl.yaml")


if __name__ == "__main__":
    main()
