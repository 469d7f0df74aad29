"""The engine flags the commands share reach the engine (flexsarathi/cli/engine_args.py)."""
from __future__ import annotations

import argparse

import pytest

from flexsarathi.cli.engine_args import add_model_args, build_llm


@pytest.mark.parametrize("flags, graphs", [([], None), (["--no-cuda-graphs"], False)])
def test_no_cuda_graphs_reaches_the_engine(tiny_checkpoint, tmp_path, flags, graphs):
    """--no-cuda-graphs turns decode graphs off; without it the engine's default holds (on for CUDA)."""
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", tiny_checkpoint("opt")[0], "--device", "cpu", "--dtype", "float32",
                              "--offload-dir", str(tmp_path), *flags])
    llm, _ = build_llm(args, None)
    with llm:
        assert llm.engine.engine_config.cuda_graphs is graphs
        assert llm.engine.graph_passes is None  # the CPU captures nothing unless asked
