"""The chunk engine and what it rests on: the model protocol, gradient dictionaries, input checks.

* :mod:`.protocol`  -- the chunk-model protocol: the only thing the engines know about a model
* :mod:`.grads`     -- gradient dictionaries: flatten, unflatten, accumulate into .grad
* :mod:`.checks`    -- one validator per concept, shared by every public function
* :mod:`.chunk_vjp` -- vector-Jacobian products of one rebuilt chunk for labelled seeds
* :mod:`.engine`    -- dense and SeCO gradients, and the chunk sweep every estimator uses
"""

__all__: list[str] = []
