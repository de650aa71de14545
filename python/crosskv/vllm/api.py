"""How crosskv's connector fits the installed vLLM's connector interface, checked by introspection (the tests run it
against whichever vLLM is installed; `python -m crosskv.vllm.api` prints it for an operator's vLLM)."""
from __future__ import annotations

import inspect


def _params(fn) -> list[tuple[str, object]]:
    """A method's parameters as (name, kind), without annotations or defaults."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def api_mismatches(cls, base) -> list[str]:
    """Where `cls` does not implement `base`: an abstract method left abstract, or a method (abstract or overridden)
    whose parameters differ from the base's by name, order or kind; and a constructor that does not take
    (vllm_config, role, kv_cache_config). Empty when it fits."""
    out = []
    for name in sorted(getattr(base, "__abstractmethods__", ())):
        impl = getattr(cls, name, None)
        if impl is None or getattr(impl, "__isabstractmethod__", False):
            out.append(f"{name}: abstract in {base.__name__}, not implemented")
    for name, want in inspect.getmembers(base, callable):
        if name.startswith("__") and name != "__init__":
            continue
        got = cls.__dict__.get(name)
        if got is None:
            continue
        got = got.__func__ if isinstance(got, (classmethod, staticmethod)) else got
        want = inspect.getattr_static(base, name)
        want = want.__func__ if isinstance(want, (classmethod, staticmethod)) else want
        if not callable(got) or not callable(want):
            continue
        if _params(got) != _params(want):
            out.append(f"{name}: takes ({', '.join(n for n, _ in _params(got))}), {base.__name__} "
                       f"({', '.join(n for n, _ in _params(want))})")
    for name in ("requires_kv_delivery", "supports_divergent_local_hybrid_hits"):  # properties of newer vLLMs
        if isinstance(inspect.getattr_static(base, name, None), property) and name in cls.__dict__ and not isinstance(
                cls.__dict__[name], property):
            out.append(f"{name}: a property in {base.__name__}, not one here")
    return out


def main() -> int:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from .connector import CrossKVConnector

    bad = api_mismatches(CrossKVConnector, KVConnectorBase_V1)
    print(f"vLLM {vllm.__version__}: CrossKVConnector " + ("fits KVConnectorBase_V1" if not bad else
                                                            "does not fit KVConnectorBase_V1:\n  " + "\n  ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
