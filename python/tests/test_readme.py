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
        for name in ("result", "sim", "moved"):
            if name in scope:
                shutil.rmtree(scope[name].run_dir)
    printed = capsys.readouterr().out
    assert "round 2: accuracy" in printed, printed
    assert len(scope["rounds"]) == 2
    assert len(scope["parts"]) == 10
    merged, model = scope["merged"], scope["result"].model
    np.testing.assert_allclose(merged["conv1.weight"], 0.75 * model["conv1.weight"], rtol=1e-6)
    # Two rounds of two clients, each adding cid + 1 (1 to 4) with equal weights.
    sim = scope["sim"]
    assert len(sim.clients) == 4 and all(c["dropped"] is None for c in sim.clients)
    added = sum(c["client_id"] for c in sim.clients) / 2
    np.testing.assert_allclose(sim.parameters[0], np.full(3, added), rtol=1e-6)
    # Server momentum moved the model past plain FedAvg's, and kept its state.
    moved = scope["moved"]
    assert len(moved.rounds) == 2 and all(c["dropped"] is None for c in moved.clients)
    assert not np.array_equal(moved.parameters[0], sim.parameters[0])
