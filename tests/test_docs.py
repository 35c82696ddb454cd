"""The user documentation's examples run, and its tables say what the code does."""

from __future__ import annotations

from pathlib import Path
import re

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def code_blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


def test_the_python_examples_of_usage_md_run_in_order(tmp_path, monkeypatch):
    """Every Python block of docs/usage.md, in one namespace, in an empty folder (the first writes the data)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NIPYPE_NO_ET", "1")
    blocks = code_blocks("usage.md", "python")
    assert len(blocks) >= 4
    namespace = {"__name__": "__docs__"}
    for number, block in enumerate(blocks, 1):
        source = tmp_path / f"usage_block_{number}.py"  # a real file: Nipype's Function nodes read the source
        source.write_text(block)
        try:
            exec(compile(block, str(source), "exec"), namespace)
        except Exception as err:  # say which block failed
            pytest.fail(f"usage.md python block {number} failed: {type(err).__name__}: {err}\n{block}")
    assert Path("dwi_denoised.nii.gz").is_file() and Path("qc/spectra.png").is_file()
    assert list(Path("results/denoised").glob("*.nii.gz")), "the Nipype example's DataSink wrote the series"


def test_the_methods_example_of_citing_md_runs_and_matches_its_quote(capsys):
    (block,) = code_blocks("citing.md", "python")
    exec(compile(block, "citing.md", "exec"), {})
    printed = " ".join(capsys.readouterr().out.split())
    quoted = " ".join(line.lstrip("> ") for line in (DOCS / "citing.md").read_text().splitlines()
                      if line.startswith("> "))
    quoted = " ".join(quoted.replace("Veraart et al., 2016", "[@veraart2016]")
                      .replace("Cordero-Grande et al., 2019", "[@cordero2019]")
                      .replace("Olesen et al., 2023", "[@olesen2023]").split())
    from mppca_nipype import __version__

    assert quoted.replace("0.1.0", __version__) in printed


def test_the_mppca_denoise_and_mppca_noise_examples_of_usage_md_run_in_order(tmp_path, monkeypatch):
    import shlex

    from mppca_nipype.cli import denoise as denoise_command, noise as noise_command
    from mppca_nipype.phantoms import dwi_phantom
    import nibabel as nib
    import numpy as np

    monkeypatch.chdir(tmp_path)
    noisy, truth, bvals, _ = dwi_phantom((16, 16, 12), 20, sigma=20.0)
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), "dwi.nii.gz")
    nib.save(nib.Nifti1Image((truth[..., 0] > 0).astype(np.uint8), np.eye(4)), "mask.nii.gz")
    Path("dwi.bval").write_text(" ".join(f"{b:g}" for b in bvals) + "\n")
    Path("volume_groups.txt").write_text("\n".join(str(i // 10) for i in range(20)) + "\n")
    for echo in (1, 2, 3):
        nib.save(nib.Nifti1Image(noisy * np.float32(0.8**echo), np.eye(4)), f"echo-{echo}.nii.gz")
    commands = [line for block in code_blocks("usage.md", "bash")
                for line in block.replace("\\\n", " ").splitlines()
                if line.startswith(("mppca-denoise ", "mppca-noise "))]
    assert len(commands) == 7
    for command in commands:
        program, *args = shlex.split(command)
        if program == "mppca-denoise":
            main, args = denoise_command.main, args + ["--device", "cpu"]
        else:
            main = noise_command.main
        try:
            main(args + ["--quiet", "--nprocs", "1"])
        except SystemExit as stopped:
            assert stopped.code in (0, None), command
    assert Path("noise.nii.gz").is_file() and Path("rank.nii.gz").is_file() and Path("sigma.nii.gz").is_file()
    assert all(Path(f"{name}.nii.gz").is_file() for name in ("dwi_den_shells", "dwi_den_groups", "echo-3_den"))


@pytest.mark.parametrize("page", [DOCS / "options.md", DOCS.parent / "README.md"], ids=["options.md", "README.md"])
def test_the_options_table_gives_the_engines_defaults(page):
    """docs/options.md's and the README's tables: one row per option, its default the engine's (DEFAULTS; the
    filter's with complex data's beside it, COMPLEX_FILTER)."""
    from mppca_nipype.engine import COMPLEX_FILTER, DEFAULTS

    rows = {}
    for line in page.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0].strip("`")] = cells[2]
    for option, default in DEFAULTS.items():
        expected = f"`{default}`" + (f"; `{COMPLEX_FILTER}` for complex data" if option == "filter" else "")
        if option in rows or page.name == "options.md":
            assert rows.get(option) == expected, f"{page.name} gives {option} default {rows.get(option)!r}"


def test_the_outputs_page_names_what_bids_py_names():
    from mppca_nipype.bids import BIDSIGNORE, derivative_names, report_names

    text = (DOCS / "outputs.md").read_text()
    source = "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_bold.nii.gz"
    for name in [*derivative_names(source).values(), *report_names(source).values()]:
        assert name in text, f"outputs.md does not show {name}"
    pair = [f"sub-01/func/sub-01_task-rest_part-{part}_bold.nii.gz" for part in ("mag", "phase")]
    for name in derivative_names(*pair).values():
        assert name.removesuffix(".json").removesuffix(".nii.gz") in text, f"outputs.md does not show {name}"
    for pattern in BIDSIGNORE:
        assert f"`{pattern}`" in text


def test_every_benchmark_result_is_cited_by_benchmarks_md_and_records_its_commit():
    """docs/benchmarks.md cites each file of benchmarks/results (by name), and each JSON names the commit it
    measured (``harness.stamp``'s ``commit``, or the older ``machine.git_commit``)."""
    import json

    results = DOCS.parent / "benchmarks" / "results"
    text = (DOCS / "benchmarks.md").read_text()
    jsons = sorted(results.glob("*.json"))
    assert jsons
    for path in sorted(results.iterdir()):
        cited = path.name in text or (path.suffix == ".md" and path.with_suffix(".json").name in text)
        assert cited, f"docs/benchmarks.md does not cite benchmarks/results/{path.name}"
    for path in jsons:
        data = json.loads(path.read_text())
        commit = (data.get("stamp") or {}).get("commit") or (data.get("machine") or {}).get("git_commit")
        assert commit and re.fullmatch(r"[0-9a-f]{40}", commit), f"{path.name} records no commit"
        assert commit[:7] in text, f"docs/benchmarks.md does not give {path.name}'s commit {commit[:7]}"
