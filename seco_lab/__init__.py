"""seco_lab: chunk-wise long-context training (SeCO / SpaCO) and exact verification
of its gradient estimators.  The subpackages follow the data:

    models/ -> core/ (the chunk engine) -> estimators/ -> stats/ -> studies/ -> report/

with data/ feeding the models, training/ (``seco-lab train``) beside them, integrations/
(the HF Trainer) on top, and on this floor what every layer shares: cli, config,
field_types, store, folder_lock; and ``seco_lab.audit``, the Python front of studies/audit
under the command's name.
See README.md ("Layout") and docs/estimators.md.

The public names are imported on first use (PEP 562), so that ``seco-lab --help`` and
the command line's refusals do not wait for torch to import.
"""

from importlib import import_module as _import_module

__version__ = "0.1.0"

_EXPORTS = {
    "dense_grad": "core.engine", "forward_loss": "core.engine", "seco_grad": "core.engine", "seco_step": "core.engine",
    "truncated_grad": "core.engine",
    "Expectation": "stats.enumeration", "enumerate_expectation": "stats.enumeration",
    "ChainBasis": "estimators.spaco", "HopStrata": "estimators.spaco", "chain_basis": "estimators.spaco",
    "hop_strata": "estimators.spaco", "spaco_grad": "estimators.spaco",
    "GradDict": "core.grads", "accumulate_grads": "core.grads", "flatten": "core.grads", "unflatten": "core.grads",
    "TinyConfig": "models.tiny_config",
    "TinyTransformer": "models.tiny",
    "ChunkModel": "core.protocol", "ChunkOutput": "core.protocol",
    "SCHEME_NAMES": "estimators.schemes", "Sampler": "estimators.schemes", "Scheme": "estimators.schemes",
    "get_scheme": "estimators.schemes", "make_scheme": "estimators.schemes",
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
