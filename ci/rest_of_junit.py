"""The test ids a pytest run did not reach, for the next device call (one call runs 600 s at most):

    python3 ci/rest_of_junit.py JUNIT_XML [PYTEST_ARGS...]  -> one node id a line, on stdout

Collects what ``pytest -m cuda PYTEST_ARGS`` (default: tests) would run and prints the ids that the
earlier run's JUnit XML (``--junitxml``: every test it finished, passed, failed or skipped) does not
list. `REST_OF=JUNIT_XML bash ci/gpu-suite.sh` runs those.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def node_id(classname: str, name: str) -> str:
    """``tests.test_x.TestY`` + ``test_z[p]`` -> ``tests/test_x.py::TestY::test_z[p]``."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that names a module file
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(path):
            return "::".join([path, *parts[i:], name])
    raise ValueError(f"no module file for JUnit classname {classname!r}")


def finished(junit: str) -> set[str]:
    return {node_id(tc.get("classname"), tc.get("name")) for tc in ET.parse(junit).iter("testcase")
            if tc.get("classname")}  # fmt: skip


def collected(args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run([*command, *(args or ["tests"])], capture_output=True, text=True)
    if out.returncode not in (0, 5):  # 5: nothing collected
        tail = out.stdout[-2000:] + out.stderr[-2000:]
        sys.exit(f"rest_of_junit: pytest --collect-only failed ({out.returncode}):\n{tail}")
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python3 ci/rest_of_junit.py JUNIT_XML [PYTEST_ARGS...]")
    done = finished(sys.argv[1])
    rest = [i for i in collected(sys.argv[2:]) if i not in done]
    print(f"rest_of_junit: {len(done)} finished, {len(rest)} to run", file=sys.stderr)
    print("\n".join(rest))


if __name__ == "__main__":
    main()
