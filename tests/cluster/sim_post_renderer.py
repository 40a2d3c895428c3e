"""helm's post-renderer for tests/cluster/test_helm.py: the chart's DaemonSet pointed at the
simulated node's hardware (kube.on_sim_node), everything else of the render as helm made it.

    helm install ... --post-renderer PYTHON --post-renderer-args THIS_FILE --post-renderer-args NODE_ROOT \
        [--post-renderer-args NAME=VALUE ...]

NAME=VALUE sets one of the driver container's variables (a flag the chart has no value for).

helm writes the rendered manifest to stdin and installs what comes out of stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from kube import on_sim_node


def main(node_root: str, *variables: str) -> None:
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    env = dict(v.split("=", 1) for v in variables)
    for doc in docs:
        if doc["kind"] == "DaemonSet":
            on_sim_node(doc, Path(node_root), env)
    yaml.safe_dump_all(docs, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:])
