"""SpaCO's estimators: how the backpropagated chunks are drawn, how they are compensated, and the sparse engine.

* :mod:`.samplers`       -- chunk samplers and the exact chance that given chunks are drawn
* :mod:`.scheme_factors` -- the built-in schemes' factors c_0, c_q and expected weights w(p)
* :mod:`.schemes`        -- SpaCO compensation schemes by name (get_scheme, make_scheme)
* :mod:`.spaco`          -- the sparse engine (spaco_grad), the hop strata, the chain basis
"""

__all__: list[str] = []
