"""How far apart are two bf16 implementations of the same random Qwen2.5-0.5B-shaped model, against fp32 truth?

Prints relative logits errors: ours-bf16 vs HF-bf16 (sdpa and eager), and each vs HF-fp32, per sequence length.
"""

import torch
import transformers

from nonstop.bench.shapes import hf_config_dict
from nonstop.models import CausalLM, ModelConfig, PackedAttention, packed_positions

CFG = hf_config_dict("qwen2.5-0.5b")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


torch.manual_seed(1234)
hf_cfg = transformers.AutoConfig.for_model(**CFG)
ref32 = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).cuda().eval()
sd = ref32.state_dict()
refbf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).cuda().eval()
refbf.load_state_dict(sd)
hf_cfg_eager = transformers.AutoConfig.for_model(**CFG, attn_implementation="eager")
refeager = transformers.AutoModelForCausalLM.from_config(hf_cfg_eager, dtype=torch.bfloat16).cuda().eval()
refeager.load_state_dict(sd)
ours = CausalLM(ModelConfig.from_hf(hf_cfg.to_dict())).to(device="cuda", dtype=torch.bfloat16).eval()
ours.load_state_dict(sd)
ours32 = CausalLM(ModelConfig.from_hf(hf_cfg.to_dict())).to(device="cuda").eval()
ours32.load_state_dict(sd)
lengths = [37, 256, 5, 300, 129]
seqs = [torch.randint(0, CFG["vocab_size"], (n,), device="cuda") for n in lengths]
with torch.no_grad():
    h = ours(torch.cat(seqs), packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda"))
    lg = ours.compute_logits(h)
    h32 = ours32(torch.cat(seqs), packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda"))
    lg32 = ours32.compute_logits(h32)
    o = 0
    print("len  ours~hfbf  ours~fp32  hfbf~fp32  eager~fp32  eager~hfbf  ours32~hf32")
    for s in seqs:
        n = len(s)
        a = lg[o : o + n]
        t = ref32(s[None]).logits[0]
        b = refbf(s[None]).logits[0]
        e = refeager(s[None]).logits[0]
        print(
            f"{n:4d}  {rel(a, b):.2e}  {rel(a, t):.2e}  {rel(b, t):.2e}  {rel(e, t):.2e}  {rel(e, b):.2e}  "
            f"{rel(lg32[o : o + n], t):.2e}"
        )
        o += n
