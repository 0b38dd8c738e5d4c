"""bench/rekey_tuning.py: the parts that decide whether a tuned choice is carried over (the
compilation itself is the static audit's, tested there)."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from ssa_flash.triton import launch, tiles, tuning_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rekey_tuning", ROOT / "bench" / "rekey_tuning.py")
rekey = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rekey)

_PTX = """//
.version 8.7
.target sm_90a
.file 1 "/tmp/old/ssa_flash/triton/forward.py"
.visible .entry attention_fwd_kernel(
{
\t.loc\t1 120 5
\tadd.s32 \t%r1, %r2, %r3;
$L__tmp0:
\t.loc\t1 133 9
\tmul.f32 \t%f1, %f2, 0f3FB8AA3B;
\tret;
}
\t.section\t.debug_abbrev
\t{
.b8 1
.b8 17
\t}
\t.section\t.debug_info
\t{
.b32 100
\t}
"""


def test_code_text_drops_line_numbers_and_paths_only():
    moved = _PTX.replace("/tmp/old/", "/work/main/").replace("1 120 5", "1 180 5").replace(".b32 100", ".b32 140")
    assert rekey.code_text(moved) == rekey.code_text(_PTX)
    assert "mul.f32" in rekey.code_text(_PTX) and ".loc" not in rekey.code_text(_PTX)
    assert ".debug" not in rekey.code_text(_PTX) and ".b8 17" not in rekey.code_text(_PTX)
    changed = _PTX.replace("0f3FB8AA3B", "0f3FB8AA3C")  # a constant of the code
    assert rekey.code_text(changed) != rekey.code_text(_PTX)


def test_a_rekeyed_entry_is_where_the_launcher_looks(tmp_path, monkeypatch):
    """The key text round-trips and the file name is tuning_cache.cache_path's."""
    monkeypatch.setenv("SSA_FLASH_CACHE_DIR", str(tmp_path))
    cands = tiles.block_candidates(90, 128, __import__("torch").bfloat16, "fwd")
    monkeypatch.setattr(tuning_cache, "gpu_name", lambda device: "NVIDIA H200")
    key = tuning_cache.cache_key(launch.attention_fwd_kernel, "fwd", None, 128, "torch.bfloat16", (1, 2), {"SCORE": 1},
                            cands)
    fields = rekey.parse_key(key)
    assert rekey.format_key(fields) == key
    assert fields["kernel"] == tuning_cache.kernel_identity(launch.attention_fwd_kernel)
    assert rekey.cache_file_name(key) == tuning_cache.cache_path(key).name
    assert rekey.gpu_arch(fields["gpu"]) == 90 and rekey.gpu_arch("Tesla V100-SXM2-16GB") is None


def test_only_dense_specialisations_are_mapped():
    fields = {"name": "fwd", "head_block": "128", "dtype": "torch.bfloat16",
              "consts": str(sorted({"SCORE": "1", "CAUSAL": "False", "DROPOUT": "True"}.items()))}
    assert "DROPOUT" in rekey._variant(fields, 90)
    fields["consts"] = str(sorted({"SCORE": "1", "CAUSAL": "True", "ADAPTIVE": "True", "DROPOUT": "False"}.items()))
    v = rekey._variant(fields, 90)
    assert (v.kernel, v.op, v.causal, v.mask, v.head_dim, v.dtype, v.arch) == ("fwd", "ssa_adaptive", True, "none",
                                                                              128, "bf16", 90)
    assert json.loads(rekey.group_of(dict(fields, kernel="k", candidates="[]")))[1] == "fwd"
