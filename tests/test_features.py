"""The shared feature matrix (tests/features.py) itself: its rows take every feature with every
variant, and each implementation's file runs every row it supports."""
import features


def test_every_feature_with_every_variant():
    """Each feature switch appears in some row of each variant (every score function of the
    registry, with and without the adaptive temperature): a feature added to ``Row``, or a score
    function added to ``ssa_flash.scores``, without rows for every variant fails here."""
    switches = set().union(*(r.features() for r in features.ROWS)) - set(features.MODES)
    expected = ({"causal", "gqa", "dropout", "window", "varlen", "odd_dims", "dlse", "deterministic", "sinks", "softcap"}
                | {f"mask:{m}" for m in features.MASKS if m})
    assert expected <= switches, sorted(expected - switches)
    for mode in features.MODES:
        seen = set().union(*(r.features() for r in features.ROWS if r.mode == mode))
        core = {"causal", "gqa", "dropout", "window", "varlen", "odd_dims", "dlse", "deterministic", "sinks",
                "softcap"}
        assert core <= seen, (mode, sorted(core - seen))
        bool_kinds = {"mask:bool", "mask:bool_empty_rows", "mask:key_padding"}
        assert seen & bool_kinds and any(f.startswith("mask:float") for f in seen), mode


def test_row_ids_are_unique():
    ids = [str(r) for r in features.ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_unsupported_rows_are_left_out():
    assert all("varlen" not in r.features() for r in features.rows_for("cuda"))
    assert features.rows_for("triton") == features.ROWS == features.rows_for("reference")
