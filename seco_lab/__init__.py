"""seco_lab: chunk-wise long-context training (SeCO / SpaCO) and exact verification
of its gradient estimators.  Data flows model -> chunk engine -> estimators ->
analysis -> reports; see README.md and docs/estimators.md.

The public names are imported on first use (PEP 562), so that ``seco-lab --help`` and
the command line's refusals do not wait for torch to import.
"""

from importlib import import_module as _import_module

__version__ = "0.1.0"

_EXPORTS = {
    "dense_grad": "engine", "forward_loss": "engine", "seco_grad": "engine", "seco_step": "engine",
    "truncated_grad": "engine",
    "Expectation": "enumeration", "enumerate_expectation": "enumeration",
    "ChainBasis": "estimators", "HopStrata": "estimators", "chain_basis": "estimators", "hop_strata": "estimators",
    "spaco_grad": "estimators",
    "GradDict": "grads", "accumulate_grads": "grads", "flatten": "grads", "unflatten": "grads",
    "TinyConfig": "tiny_config", "TinyTransformer": "model",
    "ChunkModel": "protocol", "ChunkOutput": "protocol",
    "SCHEME_NAMES": "schemes", "Sampler": "schemes", "Scheme": "schemes", "get_scheme": "schemes",
    "make_scheme": "schemes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
