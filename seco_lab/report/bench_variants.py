"""The engine variants ``experiments/bench_hf.py --compare`` times beside the engine, as its report reads them.

A module of its own, with no imports, so the benchmark's argument parser reads the labels without pandas."""

__all__ = ["ENGINE_VARIANTS"]

#: engine variants that experiments/bench_hf.py times beside the engine, interleaved in one process
#: (``--compare NAME``): the label suffix of the variant's rows, what the variant does, what the engine does,
#: and the section the report gives the pair
ENGINE_VARIANTS = {
    "pass1": (" (pass 1 chunk by chunk)", "chunk by chunk", "spans",
              "Pass 1 in spans, side by side (one process, interleaved rounds)",
              "The engine's pass 1 keeps no graph, so it forwards spans of up to 512 tokens (whole chunks) and splits "
              "their keys/values into the chunks' leaves (docs/cost.md); the same steps with pass 1 chunk by chunk, "
              "timed in the same process, are the 'before'."),
    "fused": (" (layer gradients through autograd)", "through autograd", "into .grad",
              "Layer gradients added into .grad, side by side (one process, interleaved rounds)",
              "In pass 2 the linear and embedding layers add their weight gradients into .grad themselves, one "
              "in-place product per chunk (seco_lab.models.fused_grads), instead of a product that autograd then "
              "adds; the embedding adds only its looked-up rows. The same steps with every gradient through "
              "autograd, timed in the same process, are the 'before'."),
    "keep": (" (drawn chunks rebuilt)", "rebuilt", "kept from pass 1",
             "SpaCO with pass-1 graphs kept, side by side (one process, interleaved rounds)",
             "Pass 1 forwards the last drawn chunks with a graph, alone, and pass 2 backpropagates those graphs "
             "instead of rebuilding the chunks (spaco_grad(keep_graphs=n), HFChunkModel.keep_graphs): n chunk "
             "forwards fewer for n chunks' activations held from pass 1 to pass 2. The same steps rebuilding every "
             "drawn chunk, timed in the same process, are the 'before'."),
    "values": (" (rebuilt caches compared by metadata)", "metadata", "values",
                "The values check of rebuilt chunks, side by side (one process, interleaved rounds)",
                "Pass 2 compares every rebuilt chunk's keys/values with its first pass by value (seco_lab.core.checks:"
                " the relative L2 difference within rounding), which refuses randomness user code puts in a forward; "
                "the same steps comparing shape, dtype and device only (recompute_check('metadata')), timed in the "
                "same process, are the 'before'."),
}
