import re
import shutil

import numpy as np

from conftest import FIXTURE_DATA, REPO


def test_the_readmes_python_block_runs_as_written(monkeypatch, capsys):
    readme = (REPO / "README.md").read_text()
    section = readme.split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the From Python section has one Python block"
    # The fixture's 600 training samples stand in for Fashion-MNIST.
    monkeypatch.setenv("COHORT_DATA_DIR", str(FIXTURE_DATA))
    monkeypatch.chdir(REPO)
    scope = {}
    try:
        exec(compile(blocks[0], "README.md", "exec"), scope)
    finally:
        if "result" in scope:
            shutil.rmtree(scope["result"].run_dir)
    printed = capsys.readouterr().out
    assert "round 2: accuracy" in printed, printed
    assert len(scope["rounds"]) == 2
    assert len(scope["parts"]) == 10
    merged, model = scope["merged"], scope["result"].model
    np.testing.assert_allclose(merged["conv1.weight"], 0.75 * model["conv1.weight"], rtol=1e-6)
