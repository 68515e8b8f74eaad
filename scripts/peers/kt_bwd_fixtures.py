"""Write KT-Kernel's own backward transposes for small int4 layers: the fixtures that prove
`kt convert --backward` writes KT's bytes (tests/fixtures/kt_bwd/, read by
host/tests/kt_fixtures.rs).

    python kt_bwd_fixtures.py OUT_DIR CASE

(one case a process: KT's thread pool is fixed by its first wrapper)

Run by scripts/kt-bwd-fixtures.sh with KT-Kernel 0.7.2's wheel first on PYTHONPATH and torch
installed (KT's SFT wrapper needs torch). For each case KT's AMXINT4_SFT wrapper loads bf16
weights and writes its transposes (`save_backward_weights_from_tensors`, its `.kt` files
`INT4_{gate,up,down}_bwd_{e}_..._{quant,scale}_.kt` per NUMA part), which are stored under
the converted format's keys, `blk.0.ffn_{gate,up,down}_bwd_exps.{e}.numa.{n}.{weight,scale}`.
Weights are not stored: both sides make them from SplitMix64 as kt_fixtures.py does.
"""

import os
import sys
import tempfile

import numpy as np
import torch
from kt_fixtures import merged, values  # beside this file
from kt_kernel import KTMoEWrapper
from safetensors.numpy import save_file

# name, experts, hidden, intermediate, NUMA parts: two parts; and a K (H = 3712) of one K
# block of 3584 and a short one of 128 for the down transposes.
CASES = [("int4_parts2", 2, 256, 256, 2), ("int4_k3712", 1, 3712, 128, 1)]


def case(out_dir, name, E, H, I, parts):
    bf = lambda bits: torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    gate, up, down = bf(values(1, (E, I, H), 1 / 16)), bf(values(2, (E, I, H), 1 / 16)), bf(values(3, (E, H, I), 1 / 16))
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=1, hidden_size=H, moe_intermediate_size=I,
                     num_gpu_experts=0, gpu_experts_mask=None, cpuinfer_threads=parts, threadpool_count=parts,
                     weight_path="", chunked_prefill_size=16, method="AMXINT4_SFT", mode="sft", lora_rank=4,
                     lora_alpha=8.0)
    ident = torch.arange(E)
    w.load_weights_from_tensors(gate, up, down, ident)
    scratch = tempfile.mkdtemp(prefix="kt_bwd_fixture_")
    w.save_backward_weights_from_tensors(gate, up, down, ident, scratch)
    tensors = merged(scratch, "INT4", "bwd_")
    assert len(tensors) == 6 * E * parts, sorted(tensors)
    meta = {"method": "AMXINT4", "experts": str(E), "top_k": "1", "hidden": str(H), "intermediate": str(I),
            "parts": str(parts)}
    os.makedirs(f"{out_dir}/{name}", exist_ok=True)
    save_file(tensors, f"{out_dir}/{name}/model-00001-of-00001.safetensors", metadata=meta)
    print(f"kt-bwd-fixtures: {name}: AMXINT4 E={E} H={H} I={I} parts={parts}", flush=True)


if __name__ == "__main__":
    case(sys.argv[1], *next(c for c in CASES if c[0] == sys.argv[2]))
