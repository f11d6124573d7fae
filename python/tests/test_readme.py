"""The README's Python example, run as it is written (with the test's worker
address and the model's path)."""

import contextlib
import io
import os
import re

from conftest import MODEL, SOURCE, require_model


def test_readme_example_runs(stack):
    require_model()
    _, worker = stack
    with open(os.path.join(SOURCE, "README.md")) as f:
        readme = f.read()
    m = re.search(r"<!-- python-example -->\n```python\n(.*?)```", readme, re.S)
    assert m, "README.md lost its Python example"
    code = m.group(1)
    lines = [l for l in code.splitlines() if l.strip()]
    assert len(lines) < 20, "the README promises under 20 lines"
    code = code.replace("127.0.0.1:7071", worker.address)
    code = code.replace("../shared/models/stories260K.bin", MODEL)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert [l.split()[1] for l in lines] == ["0", "1", "2"], lines
    assert all(len(l.split("[")[1].split(",")) == 10 for l in lines), lines


def test_version_is_the_projects():
    import kvtier
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        m = re.search(r"^project\(kvtier VERSION ([0-9.]+)", f.read(), re.M)
    assert m, "CMakeLists.txt's project() has no version"
    assert kvtier.__version__ == m.group(1)
