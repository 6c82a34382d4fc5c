"""--plot on estimate and sweep: the PNG renders, draws the estimate's own numbers, and bad paths are refused."""

import pytest

pytest.importorskip("matplotlib")

import trainmem  # noqa: E402
from trainmem.hardware import get_gpu  # noqa: E402
from trainmem.plots import plot_estimate, plot_sweep  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _image_size(path) -> tuple[int, int]:
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_estimate_plot_draws_each_phase_by_category_and_the_gpu_lines(tmp_path):
    est = trainmem.estimate("llama-3-8b", recipe="pure-bf16", batch=4, seq=4096, checkpointing="full",
                            gpu="H100-80GB")
    out = tmp_path / "memory.png"
    drawn = plot_estimate(est, out, "GiB", get_gpu("H100-80GB"))
    assert out.read_bytes()[:8] == PNG_SIGNATURE and _image_size(out) == (1100, 616)
    assert drawn["bars"] == {ph.name: ph.by_category() for ph in est.phases}
    assert drawn["peak_phase"] == est.peak.phase
    assert drawn["lines"] == {"required": est.peak.required_bytes, "H100-80GB": get_gpu("H100-80GB").memory_bytes}
    assert [p.name for p in tmp_path.iterdir()] == ["memory.png"]  # no temporary left behind


def test_estimate_plot_without_a_gpu_draws_sizes_on_both_sides_of_the_need(tmp_path):
    est = trainmem.estimate("llama-3-8b", recipe="pure-bf16", batch=1, seq=2048)
    drawn = plot_estimate(est, tmp_path / "m.png")
    sizes = [b for name, b in drawn["lines"].items() if name != "required"]
    assert any(b < est.peak.required_bytes for b in sizes) and any(b >= est.peak.required_bytes for b in sizes)


def test_static_only_estimates_plot_their_components(tmp_path):
    est = trainmem.estimate(params=7e9)  # a nominal size, no architecture: static memory only
    assert est.peak is None
    drawn = plot_estimate(est, tmp_path / "static.png")
    assert drawn["bars"] == {"static": {c.name: c.bytes for c in est.static}} and drawn["peak_phase"] is None


def test_sweep_plot_marks_where_each_gpu_runs_out(tmp_path):
    estimates = trainmem.sweep("llama-3-8b", batches=[1, 2, 4, 8, 16, 32], seqs=[2048], recipe="pure-bf16",
                               checkpointing="full")
    h100 = get_gpu("H100-80GB")
    drawn = plot_sweep(estimates, tmp_path / "sweep.png", "GiB", h100)
    assert drawn["axis"] == "batch"
    assert drawn["curves"] == {"seq 2048": [(e.settings.batch, e.peak.required_bytes) for e in estimates]}
    first_too_big = next((e.settings.batch for e in estimates if not e.peak.fits(h100)), None)
    assert drawn["runs_out"]["seq 2048"]["H100-80GB"] == first_too_big


def test_cli_plots_and_refuses_bad_paths_in_one_line(run_cli, tmp_path):
    out = tmp_path / "e.png"
    code, stdout, _ = run_cli("estimate", "gpt2", "--plot", str(out))
    assert code == 0 and out.exists() and f"plot written to {out}" in stdout
    code, _, _ = run_cli("sweep", "gpt2", "--batch", "1,2", "--seq", "128", "--plot", str(tmp_path / "s.png"))
    assert code == 0 and (tmp_path / "s.png").exists()
    for args, says in [
        (("estimate", "gpt2", "--plot", str(tmp_path / "missing" / "e.png")), "does not exist"),
        (("estimate", "gpt2", "--plot", str(tmp_path / "e.jpg")), "ending in .png"),
        (("sweep", "gpt2", "--batch", "2", "--seq", "128", "--plot", str(tmp_path / "x.png")), "more than one"),
    ]:
        code, _, err = run_cli(*args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.png", "s.png"]


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import matplotlib.figure

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.raises(OSError):
        plot_estimate(trainmem.estimate("gpt2"), tmp_path / "e.png")
    assert list(tmp_path.iterdir()) == []
