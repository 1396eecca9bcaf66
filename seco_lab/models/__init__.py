"""Chunk models (:class:`seco_lab.core.protocol.ChunkModel`): the tiny transformer, Hugging Face causal LMs, and a real
pretrained LM offline.

* :mod:`.tiny_config`  -- the tiny transformer's shape, torch-free (the CLI's flags)
* :mod:`.tiny`         -- the tiny Llama-style transformer that runs chunk by chunk
* :mod:`.hf_attention` -- the chunk-wise KV cache and attention kernel behind HFChunkModel
* :mod:`.hf`           -- Hugging Face causal LMs as chunk models, LoRA through peft
* :mod:`.fused_grads`  -- linear and embedding gradients added straight into .grad (pass 2 of HF models)
* :mod:`.pretrained`   -- SmolLM2-135M-Instruct offline, from its GGUF file
"""

__all__: list[str] = []
