"""seco_lab: chunk-wise long-context training (SeCO / SpaCO) and exact verification
of its gradient estimators.  Data flows model -> chunk engine -> estimators ->
analysis -> reports; see README.md and docs/estimators.md."""

from .engine import dense_grad, forward_loss, seco_grad, seco_step, truncated_grad
from .enumeration import Expectation, enumerate_expectation
from .estimators import ChainBasis, HopStrata, chain_basis, hop_strata, spaco_grad
from .grads import GradDict, accumulate_grads, flatten, unflatten
from .model import TinyConfig, TinyTransformer
from .protocol import ChunkModel, ChunkOutput
from .schemes import SCHEME_NAMES, Sampler, Scheme, get_scheme, make_scheme

__version__ = "0.1.0"

__all__ = [
    "SCHEME_NAMES",
    "ChainBasis",
    "ChunkModel",
    "ChunkOutput",
    "Expectation",
    "GradDict",
    "HopStrata",
    "Sampler",
    "Scheme",
    "TinyConfig",
    "TinyTransformer",
    "accumulate_grads",
    "chain_basis",
    "dense_grad",
    "enumerate_expectation",
    "flatten",
    "forward_loss",
    "get_scheme",
    "hop_strata",
    "make_scheme",
    "seco_grad",
    "seco_step",
    "spaco_grad",
    "truncated_grad",
    "unflatten",
]
