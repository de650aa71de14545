"""Retention with its controls: how much of what the target's own prefill gives a mapped cache keeps, measured so that
a cache without the context's content cannot pass.

    from crosskv.retention import measure, table
    r = measure(source_model, target_model, crosskv.Mapper("out/k2"), ids, prefix_tokens=64)
    print(table(r))

`ids` [sequences, >= 2 * prefix_tokens] are held-out token ids, packed from running text (sequence i + B/2 lies far
from sequence i). For each sequence the target reads a cache of its first `prefix_tokens - 1` tokens under each
condition, then the rest of the sequence; every condition is scored on the same tokens:

    own                  the target's own prefill
    mapped               the mapper applied to the source's cache of the same tokens
    wrong_sequence       the mapper applied to the source's cache of another sequence (i + B/2)
    own_wrong_sequence   the target's own prefill of that other sequence
    zero                 an all-zero cache
    random               Gaussian noise with the mapped cache's mean and variance, per layer, keys and values apart
    mean_only            the mapped cache averaged over the sequences at each position: what a mapper that ignores
                         its input's content gives at best
    none                 no prefix

Figures (each with a 95% bootstrap interval over the sequences, resampled in pairs):

    content_share    (NLL wrong_sequence - NLL mapped) / (NLL own_wrong_sequence - NLL own): what the mapped cache
                     gains over the mapper's cache of the wrong text, as a share of what the target's own prefill
                     gains over its own prefill of the wrong text. A cache without this context's content scores 0.
                     Each condition's own figure, (NLL own_wrong_sequence - NLL c) / (the same denominator), puts own
                     at 1 and own_wrong_sequence at 0; content_share is mapped's less wrong_sequence's.
    share            (NLL none - NLL mapped) / (NLL none - NLL own): the share of the prefix's gain (secondary: a
                     content-free cache can reach it).
    choice           N-way continuation choice: the true next `choice_tokens` tokens against those of N - 1 other
                     sequences, scored by PMI (the candidate's NLL given the cache minus its NLL given no prefix), so
                     that a passage's own difficulty does not decide it. Chance is 1/N; ties share the credit.
    recall           N-way span recall, which needs the context's exact content: a span of `span_tokens` tokens of
                     the prefix against spans of other sequences' prefixes, PMI-scored as above.
    task retention   (accuracy mapped - chance) / (accuracy own - chance), per task. A task counts only where the
                     target's own prefill is far above chance (own - chance >= 0.3).
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from .hf import cache_layers, cache_only

CONDITIONS = ("own", "mapped", "wrong_sequence", "own_wrong_sequence", "zero", "random", "mean_only", "none")
TASKS = ("choice", "recall")
COUNTS_ABOVE_CHANCE = 0.3


@dataclass
class Figure:
    value: float
    low: float
    high: float

    def __str__(self):
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def as_list(self):
        return [round(self.value, 4), round(self.low, 4), round(self.high, 4)]


@dataclass
class Retention:
    """What `measure` found: per condition and sequence the continuation's mean NLL and each task's credit; the
    figures with their intervals."""
    sequences: int
    prefix_tokens: int
    choices: int
    nll: dict  # condition -> [sequences] mean NLL of the continuation
    credit: dict  # task -> condition -> [sequences] credit in [0, 1] (PMI-scored); "choice_raw" too
    content_share: Figure = None
    share: Figure = None
    accuracy: dict = field(default_factory=dict)  # task -> condition -> accuracy
    task_retention: dict = field(default_factory=dict)  # task -> Figure
    counts: dict = field(default_factory=dict)  # task -> own - chance >= COUNTS_ABOVE_CHANCE

    @property
    def chance(self):
        return 1.0 / self.choices

    def perplexity(self, condition):
        return float(np.exp(self.nll[condition].mean()))

    def content_share_of(self, condition):
        n = self.nll
        return float((n["own_wrong_sequence"] - n[condition]).mean() / (n["own_wrong_sequence"] - n["own"]).mean())

    def to_json(self):
        return {"sequences": self.sequences, "prefix_tokens": self.prefix_tokens, "choices": self.choices,
                "chance": self.chance,
                "perplexity": {c: round(self.perplexity(c), 4) for c in CONDITIONS},
                "content_share_of": {c: round(self.content_share_of(c), 4) for c in CONDITIONS},
                "share": self.share.as_list(), "content_share": self.content_share.as_list(),
                "accuracy": {t: {c: round(a, 4) for c, a in acc.items()} for t, acc in self.accuracy.items()},
                "task_retention": {t: f.as_list() for t, f in self.task_retention.items()},
                "counts": self.counts}


def _cache(layers):
    from transformers import DynamicCache

    c = DynamicCache()
    for i, (k, v) in enumerate(layers):
        c.update(k, v, i)
    return c


@torch.no_grad()
def prefill(model, ids):
    """The model's cache of `ids` [B, T]: per layer (keys post-RoPE, values) [B, H, T, D]."""
    out = model(torch.as_tensor(ids), use_cache=True, **cache_only(model))
    return cache_layers(out.past_key_values)


@torch.no_grad()
def token_nll(model, layers, inputs):
    """NLL of inputs[:, 1:] [B, n - 1] when the model reads `inputs` [B, n] after the cache `layers` (None: no prefix;
    the inputs then sit at positions 0..n-1)."""
    x = torch.as_tensor(inputs)
    kw = {}
    if layers is not None:
        t = layers[0][0].shape[2]
        kw = {"past_key_values": _cache(layers), "use_cache": True,
              "position_ids": torch.arange(t, t + x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)}
    logits = model(x, **kw).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1)
    return -lp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1).double().numpy()


def map_cache(mapper, source_layers):
    """The target's cache from the source's: a crosskv.Mapper, or any callable from layers to layers."""
    if callable(mapper) and not hasattr(mapper, "transfer"):
        return mapper(source_layers)
    from .hf import transfer_cache

    return cache_layers(transfer_cache(mapper, _cache(source_layers)))


def roll(layers, shift):
    """Each sequence's cache replaced by that of sequence i + shift."""
    return [(torch.roll(k, -shift, 0), torch.roll(v, -shift, 0)) for k, v in layers]


def control_caches(own, mapped, mapped_wrong, seed=0):
    """The conditions' caches (None for no prefix) from the target's own cache, the mapped cache, and the mapper's
    output for the source's cache of sequence i + B/2 (`mapped_wrong`)."""
    shift = own[0][0].shape[0] // 2
    g = torch.Generator().manual_seed(seed)

    def noise(x):
        return (torch.randn(x.shape, generator=g, dtype=torch.float64) * x.double().std() + x.double().mean()).to(
            x.dtype)

    return {"own": own, "mapped": mapped, "wrong_sequence": mapped_wrong,
            "own_wrong_sequence": roll(own, shift),
            "zero": [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in mapped],
            "random": [(noise(k), noise(v)) for k, v in mapped],
            "mean_only": [(k.mean(0, keepdim=True).expand_as(k).contiguous(),
                           v.mean(0, keepdim=True).expand_as(v).contiguous()) for k, v in mapped],
            "none": None}


def _bootstrap(fn, n, resamples, seed):
    """fn(index array) over the sequences, with the 2.5 and 97.5 percentiles of `resamples` resamples."""
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample whose denominator is 0 is dropped
        value = fn(np.arange(n))
        draws = np.array([fn(rng.integers(0, n, n)) for _ in range(resamples)])
    draws = draws[np.isfinite(draws)]
    lo, hi = (np.percentile(draws, [2.5, 97.5]) if len(draws) else (np.nan, np.nan))
    return Figure(float(value), float(lo), float(hi))


def _credit(scores):
    """Credit of candidate 0 (the true one) per sequence: 1/k when it ties k candidates at the lowest score."""
    best = scores.min(1, keepdims=True)
    at_best = np.isclose(scores, best, rtol=0, atol=1e-9)
    return np.where(at_best[:, 0], 1.0 / at_best.sum(1), 0.0)


def measure(source, target, mapper, ids, prefix_tokens, choices=4, choice_tokens=16, span_tokens=8, seed=0,
            resamples=2000, batch=None, tasks=TASKS):
    """Every condition and figure of this module's docstring on `ids` [B, >= 2 * prefix_tokens]. `mapper` is a
    crosskv.Mapper or a callable from the source's cache layers to the target's. `tasks`: the tasks measured (each
    costs the target 2 * choices forward passes per condition; () gives the NLL figures alone)."""
    ids = np.asarray(ids)
    B, S = ids.shape[0], prefix_tokens
    if ids.shape[1] < 2 * S or B < 2 * choices:
        raise ValueError(f"ids: expected at least {2 * choices} sequences of >= {2 * S} tokens, got {ids.shape}")
    if not 1 <= span_tokens < S - 1 or choice_tokens > S:
        raise ValueError(f"span_tokens {span_tokens} / choice_tokens {choice_tokens} do not fit a prefix of {S}")
    batch = batch or B
    head = ids[:, :S - 1]  # the cache's tokens; token S - 1 is read by the target itself in every condition
    shift = B // 2
    own = prefill(target, head)
    src = prefill(source, head)
    mapped = map_cache(mapper, src)
    caches = control_caches(own, mapped, map_cache(mapper, roll(src, shift)), seed)
    # Candidates: candidate 0 is the sequence's own; the others come from sequences i + o, o never `shift`.
    offsets = [1 + m * max(1, B // choices) for m in range(choices - 1)]
    offsets = [o if o % B != shift else o + 1 for o in offsets]
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, S - 1 - span_tokens, B)  # each prefix's span, inside the cache's tokens
    spans = np.stack([head[i, s:s + span_tokens] for i, s in enumerate(starts)])
    cont = ids[:, S:S + choice_tokens]
    last = ids[:, S - 1:S]

    def candidates(x):
        return [x] + [np.roll(x, -o, 0) for o in offsets]

    def nll(layers, inputs):  # in batches of `batch` sequences
        parts = []
        for a in range(0, B, batch):
            sl = None if layers is None else [(k[a:a + batch], v[a:a + batch]) for k, v in layers]
            parts.append(token_nll(target, sl, inputs[a:a + batch]))
        return np.concatenate(parts)

    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"tasks: expected some of {TASKS}, got {sorted(unknown)}")
    r = Retention(sequences=B, prefix_tokens=S, choices=choices, nll={}, credit={t: {} for t in tasks})
    if "choice" in tasks:
        r.credit["choice_raw"] = {}
    task_inputs = {t: [np.concatenate([last, c], 1) for c in candidates(cont if t == "choice" else spans)]
                   for t in tasks}
    base = {t: np.stack([nll(None, x).sum(1) for x in xs], 1) for t, xs in task_inputs.items()}
    for name in CONDITIONS:
        layers = caches[name]
        r.nll[name] = nll(layers, ids[:, S - 1:2 * S]).mean(1)
        for t, xs in task_inputs.items():
            scores = base[t] if layers is None else np.stack([nll(layers, x).sum(1) for x in xs], 1)
            r.credit[t][name] = _credit(scores - base[t])
            if t == "choice":
                r.credit["choice_raw"][name] = _credit(scores)
    n = r.nll
    r.content_share = _bootstrap(lambda i: (n["wrong_sequence"][i] - n["mapped"][i]).mean()
                                 / (n["own_wrong_sequence"][i] - n["own"][i]).mean(), B, resamples, seed)
    r.share = _bootstrap(lambda i: (n["none"][i] - n["mapped"][i]).mean() / (n["none"][i] - n["own"][i]).mean(),
                         B, resamples, seed)
    for t in r.credit:
        r.accuracy[t] = {c: float(r.credit[t][c].mean()) for c in CONDITIONS}
    for t in tasks:
        cr = r.credit[t]
        r.task_retention[t] = _bootstrap(lambda i: (cr["mapped"][i].mean() - r.chance)
                                         / (cr["own"][i].mean() - r.chance), B, resamples, seed)
        r.counts[t] = bool(r.accuracy[t]["own"] - r.chance >= COUNTS_ABOVE_CHANCE)
    return r


def table(r, label="mapped"):
    """The conditions side by side (markdown), then the figures."""
    lines = [f"| condition | perplexity | content share | continuation choice ({r.choices}-way, PMI) | the same, raw "
             f"| span recall (PMI) |", "|---|---|---|---|---|---|"]
    def accuracy(t, c):
        return f"{r.accuracy[t][c]:.3f}" if t in r.accuracy else "not measured"

    for c in CONDITIONS:
        lines.append(f"| {label if c == 'mapped' else c.replace('_', ' ')} | {r.perplexity(c):.2f} | "
                     f"{r.content_share_of(c):.3f} | "
                     f"{accuracy('choice', c)} | {accuracy('choice_raw', c)} | {accuracy('recall', c)} |")
    lines += ["", f"content-specific share {r.content_share}; share of the prefix's gain {r.share} "
                  f"({r.sequences} sequences, 95% bootstrap intervals)"]
    for t in r.task_retention:
        lines.append(f"task retention, {t}: {r.task_retention[t]}"
                     + ("" if r.counts[t] else f" (does not count: own prefill is less than "
                                               f"{COUNTS_ABOVE_CHANCE} above chance)"))
    return "\n".join(lines)
