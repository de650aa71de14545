"""lm-evaluation-harness with a mapped cache: any lm-eval task, scored by the target model reading the cache that the
mapper made from the source model's prefill of each request's context.

    python -m crosskv.lm_eval --model_args source=DIR,target=DIR,mapper=DIR[,mode=mapped,device=cpu,dtype=float32] \\
        --tasks arc_challenge,hellaswag --output_path out --log_samples

lm-eval's own flags pass through as they are (--tasks, --include_path, --output_path, --log_samples, --limit,
--batch_size, --num_fewshot, ...), and its output files come out as usual. From Python, importing this module
registers the model as "crosskv":

    import crosskv.lm_eval, lm_eval
    lm_eval.simple_evaluate(model="crosskv", model_args="source=...,target=...,mapper=...", tasks=[...])

For each request the context's tokens but the last are the prefix: the source model prefills them, the mapper maps
its cache, and the target reads the last context token and the continuation after it, so every continuation token
is scored (loglikelihood, loglikelihood_rolling) or generated (generate_until, greedy) from the mapped cache.
Tokenization, the empty-context prefix token, truncation and rolling windows are lm-eval's own (its `hf` model's
tokenizer handling on the target's tokenizer). `mode` gives the controls:

    mapped   the mapper on the source's cache of the context (the default)
    own      the target's own prefill: equals lm-eval's `hf` model on the target, request by request
    wrong    the mapper on the source's cache of another request's context (of a different context, half the
             requests away; its tokens cut or repeated to the same length)
    zero     an all-zero cache of the target's shape
    none     no prefix: the target reads only the last context token and the continuation

Requests are scored one at a time (a context shared by consecutive requests, such as a multiple-choice question's,
is prefilled and mapped once).
"""
import logging
import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from . import MapperError

logger = logging.getLogger(__name__)
MODES = ("mapped", "own", "wrong", "zero", "none")


class CrossKVLMError(ValueError):
    """A bad model_args value: the message names the key."""


def _model(path, dtype, device, what):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, dtype)).to(device).eval()
        return m, AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CrossKVLMError(f"model_args {what}={path}: not a Hugging Face causal LM folder ({e})") from None


@register_model("crosskv")
class CrossKVLM(TemplateLM):
    def __init__(self, source=None, target=None, mapper=None, mode="mapped", device="cpu", dtype="float32",
                 batch_size=1, max_batch_size=None, max_length=None, **unused):
        super().__init__()
        mode = "none" if mode is None else mode  # lm-eval's model_args parser reads "none" as None
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval's command line asks for cuda:0 unless --device says otherwise: the CPU where there is no GPU
            if device is not None:
                logger.warning("crosskv: device %s asked for, but torch sees no GPU: running on the CPU", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if unused:
            raise CrossKVLMError(f"model_args: unknown key(s) {', '.join(sorted(unused))}; expected source, target, "
                                 "mapper, mode, device, dtype, max_length")
        if mode not in MODES:
            raise CrossKVLMError(f"model_args mode={mode}: expected one of {', '.join(MODES)}")
        if target is None:
            raise CrossKVLMError("model_args target: required (the target model's folder)")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise CrossKVLMError(f"model_args dtype={dtype}: expected float32, bfloat16 or float16")
        needs_source = mode in ("mapped", "wrong")
        if needs_source and (source is None or mapper is None):
            raise CrossKVLMError(f"model_args source and mapper: required for mode={mode}")
        self.mode, self.device_name = mode, str(device)
        self.target, tok = _model(target, dtype, device, "target")
        # lm-eval's own `hf` model over the target: its tokenization, prefix token, truncation and max length.
        self._hf = HFLM(pretrained=self.target, tokenizer=tok, batch_size=1, device=str(device),
                        max_length=None if max_length is None else int(max_length))
        self.tokenizer = self._hf.tokenizer
        self.source = self.mapper = None
        if needs_source:
            import crosskv

            self.source, stok = _model(source, dtype, device, "source")
            if stok.get_vocab() != tok.get_vocab():
                raise CrossKVLMError(f"model_args source={source}: its tokenizer differs from the target's; a mapper "
                                     "maps KV of one tokenization")
            try:
                self.mapper = crosskv.Mapper(mapper, device="cuda" if str(device).startswith("cuda") else "cpu")
            except MapperError as e:
                raise CrossKVLMError(f"model_args mapper={mapper}: {e}") from None
        self._memo = (None, None)

    # -- what lm-eval asks of a model, from its `hf` model
    @property
    def eot_token_id(self):
        return self._hf.eot_token_id

    @property
    def prefix_token_id(self):
        return self._hf.prefix_token_id

    @property
    def max_length(self):
        return self._hf.max_length

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self._hf.tok_encode(string, add_special_tokens=add_special_tokens, **kwargs)

    def tok_decode(self, tokens, **kwargs):
        return self._hf.tok_decode(tokens, **kwargs)

    # -- the caches
    def _prefill(self, model, tokens):
        from .retention import prefill

        return prefill(model, torch.tensor([tokens], device=model.device))

    def _cache(self, prefix, other=None):
        """The target's cache of `prefix` (token ids) under this mode; None for no prefix or an empty one."""
        if not prefix or self.mode == "none":
            return None
        key = (tuple(prefix), None if other is None else tuple(other))
        if self._memo[0] == key:
            return self._memo[1]
        if self.mode == "own":
            cache = self._prefill(self.target, prefix)
        elif self.mode == "zero":
            own = self._prefill(self.target, prefix)
            cache = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in own]
        else:
            from .retention import map_cache

            tokens = prefix if self.mode == "mapped" else (list(other) * (len(prefix) // max(1, len(other)) + 1))[
                :len(prefix)]
            cache = [(k.to(self.target.dtype), v.to(self.target.dtype))
                     for k, v in map_cache(self.mapper, self._prefill(self.source, tokens))]
        self._memo = (key, cache)
        return cache

    @torch.no_grad()
    def _logits(self, cache, inputs):
        """The target's logits [n, vocab] (float32) for `inputs` read after `cache`."""
        x = torch.tensor([inputs], device=self.target.device)
        kw = {}
        if cache is not None:
            from .retention import _cache

            t = cache[0][0].shape[2]
            kw = {"past_key_values": _cache(cache), "use_cache": True,
                  "position_ids": torch.arange(t, t + len(inputs), device=x.device).unsqueeze(0)}
        return self.target(x, **kw).logits[0].float()

    def _score(self, context, continuation, other=None):
        """(sum of log p(continuation), whether it is the greedy one), context and continuation token lists, the
        context left-truncated as lm-eval's `hf` model truncates it."""
        whole = (context + continuation)[-(self.max_length + 1):]
        context = whole[:len(whole) - len(continuation)]
        logits = self._logits(self._cache(context[:-1], other), context[-1:] + continuation[:-1])
        lp = torch.log_softmax(logits, -1)
        cont = torch.tensor(continuation, device=lp.device)
        return float(lp.gather(-1, cont.unsqueeze(-1)).sum()), bool((lp.argmax(-1) == cont).all())

    def _other(self, contexts, i):
        """Another request's context for the wrong-context control: half the requests away, a different one."""
        n = len(contexts)
        for step in range(n // 2 or 1, n + n // 2):
            other = contexts[(i + step) % n]
            if other != contexts[i]:
                return other
        return [t + 1 for t in contexts[i]]  # every request has one context: shifted tokens stand in

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        contexts = [list(c) for _, c, _ in requests]
        out = []
        for i, (_, ctx, cont) in enumerate(requests):
            other = self._other(contexts, i) if self.mode == "wrong" else None
            out.append(self._score(list(ctx), list(cont), other))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        out = []
        for (text,) in [r.args for r in requests]:
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            out.append(sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows])))
        return out

    def generate_until(self, requests, disable_tqdm=False):
        contexts = [self.tok_encode(r.args[0]) for r in requests]
        out = []
        for i, r in enumerate(requests):
            kwargs = dict(r.args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            until = until + [eos] if eos not in until else until
            max_gen = int(kwargs.pop("max_gen_toks", 256))
            if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
                raise CrossKVLMError("generate_until: crosskv generates greedily (do_sample false, temperature 0)")
            ctx = contexts[i][-(self.max_length - max_gen):]
            other = self._other(contexts, i) if self.mode == "wrong" else None
            cache = self._cache(ctx[:-1], other)
            cache = None if cache is None else [(k.clone(), v.clone()) for k, v in cache]
            out.append(self._greedy(cache, ctx, max_gen, until))
        return out

    @torch.no_grad()
    def _greedy(self, cache, ctx, max_gen, until):
        """Greedy tokens after `ctx` (its last token read after `cache`), cut at the first stop string."""
        from .retention import _cache

        past = None if cache is None else _cache(cache)
        start = 0 if cache is None else cache[0][0].shape[2]
        step, tokens = ctx[-1:], []
        for n in range(max_gen):
            x = torch.tensor([step], device=self.target.device)
            pos = torch.arange(start + n, start + n + 1, device=x.device).unsqueeze(0)
            out = self.target(x, past_key_values=past, use_cache=True, position_ids=pos)
            past = out.past_key_values
            t = int(out.logits[0, -1].float().argmax())
            tokens.append(t)
            if t == self.eot_token_id:
                break
            text = self.tok_decode(tokens)
            if any(u and u in text for u in until):
                break
            step = [t]
        text = self.tok_decode(tokens)
        for u in until:
            if u:
                text = text.split(u)[0]
        return text


def main(argv=None):
    """lm-eval's command line with --model crosskv."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in argv:
        argv = ["--model", "crosskv"] + argv
    sys.argv = ["lm-eval"] + argv
    cli_evaluate()


if __name__ == "__main__":
    main()
