"""Pictures: block layout bookkeeping, and every figure renders to a PNG."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import shardkit as sk  # noqa: E402
from shardkit import viz  # noqa: E402


def test_device_blocks_cover_the_array_once_per_replica():
    mesh = sk.make_mesh("data=2,tensor=4")
    blocks = viz.device_blocks((8, 16), ("data", "tensor"), mesh)
    assert len(blocks) == 8
    assert blocks[0] == (slice(0, 4), slice(0, 4))
    assert blocks[5] == (slice(4, 8), slice(4, 8))
    rep = viz.device_blocks((8, 16), (None, "tensor"), mesh)
    assert rep[0] == rep[4] == (slice(0, 8), slice(0, 4))  # replicated over data
    both = viz.device_blocks((16,), (("data", "tensor"),), mesh)
    assert sorted(b[0].start for b in both.values()) == list(range(0, 16, 2))
    with pytest.raises(ValueError, match="does not split"):
        viz.device_blocks((6, 16), ("tensor", None), mesh)


def test_figures_save_to_png(tmp_path):
    mesh = sk.make_mesh("data=2,tensor=4")
    res = sk.search("1b", devices=64, global_batch=128, top=6)
    figs = {
        "layout": viz.array_layout((8, 16), ("data", "tensor"), mesh),
        "layout3d": viz.array_layout((2, 8, 16), (None, "data", "tensor"), mesh),
        "memory": viz.memory_bars({str(e.layout.mesh): e for e in res.estimates[:3]}, limit=80e9),
        "compare": viz.compare_layouts(res),
        "ratios": viz.estimate_vs_compiled([{"quantity": "memory/peak", "estimate": 9.0, "compiled": 10.0}]),
    }
    for name, fig in figs.items():
        path = viz.save(fig, str(tmp_path / f"{name}.png"))
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def test_plan_cli_saves_png(tmp_path):
    from shardkit import cost

    out = tmp_path / "plan.png"
    assert cost.plan_main(["--model", "125m", "--devices", "16", "--top", "4", "--png", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_pipeline_schedule_drawing():
    """One cell per (tick, device), labelled as the printed grid (F/B/W, microbatch, chunk);
    idle cells white; one colour per microbatch."""
    from matplotlib.colors import to_hex

    tab = sk.pipeline_schedule("zb-v", stages=2, microbatches=2)
    ax = viz.pipeline_schedule(tab).axes[0]
    assert len(ax.patches) == tab.op.size
    labels = [t.get_text() for t in ax.texts]
    assert len(labels) == int((tab.op != 0).sum()) and {"F0/0", "B1/1", "W0/1"} <= set(labels)
    assert "bubble" in ax.get_title()
    faces = {to_hex(p.get_facecolor()) for p in ax.patches}
    assert "#ffffff" in faces and len(faces) >= 1 + 3 * tab.microbatches - 1
