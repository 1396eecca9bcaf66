"""The estimators' statistics: exact bias, variance and MSE, and comparisons at equal compute.

* :mod:`.chain_space`   -- exact and Monte Carlo statistics in chain space (small k)
* :mod:`.strata`        -- bias, variance and MSE from hop strata alone (k = 128 and up)
* :mod:`.enumeration`   -- exact expectation and covariance by enumerating every draw
* :mod:`.equal_compute` -- methods compared at matched scale and equal compute (cost model)
"""

__all__: list[str] = []
