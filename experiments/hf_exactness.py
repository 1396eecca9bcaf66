"""Worst float64 errors of the HF adapter: chunked vs full logits and SeCO vs HF backward, with and without LoRA.

python -m experiments.hf_exactness
"""

import torch
import torch.nn.functional as F

from seco_lab import seco_grad
from seco_lab.models.hf import HFChunkModel, add_lora, build_hf_model


def main():
    torch.set_num_threads(1)
    worst = {}
    for arch in ["llama", "qwen2"]:
        for attn in ["sdpa", "eager_exact", "eager"]:
            for chunk in [4, 7]:
                m = build_hf_model(arch, attn_implementation=attn, dtype=torch.float64)
                a = HFChunkModel(m)
                g = torch.Generator().manual_seed(0)
                tok = torch.randint(0, 64, (2, 21), generator=g)
                tgt = torch.randint(0, 64, (2, 21), generator=g)
                with torch.no_grad():
                    full = m(input_ids=tok).logits
                    past = []
                    pieces = []
                    for s in range(0, 21, chunk):
                        lg, c = a.chunk_logits(tok[:, s : s + chunk], past, s)
                        pieces.append(lg)
                        past.append(c)
                e = float((torch.cat(pieces, 1) - full).norm() / full.norm())
                worst[("fwd", attn)] = max(worst.get(("fwd", attn), 0), e)
                for lora in [False, True]:
                    mm = build_hf_model(arch, attn_implementation=attn, dtype=torch.float64)
                    if lora:
                        mm = add_lora(mm, r=4, alpha=8, init_lora_weights=False).double()
                    a = HFChunkModel(mm)
                    params = [(n, p) for n, p in mm.named_parameters() if p.requires_grad]
                    logits = mm(input_ids=tok).logits
                    loss = F.cross_entropy(logits.reshape(-1, 64), tgt.reshape(-1), reduction="sum") / tgt.numel()
                    gr = torch.autograd.grad(loss, [p for _, p in params])
                    ref = {"model." + n: x for (n, _), x in zip(params, gr)}
                    _, sg = seco_grad(a, tok, tgt, chunk_size=chunk)
                    tot = sum(float(x.norm()) ** 2 for x in ref.values()) ** 0.5
                    e = max(float((sg[n] - ref[n]).norm()) / max(float(ref[n].norm()), 1e-4 * tot) for n in ref)
                    key = ("grad", attn, "lora" if lora else "full")
                    worst[key] = max(worst.get(key, 0), e)
    for k, v in worst.items():
        print(k, f"{v:.2e}")


if __name__ == "__main__":
    main()
