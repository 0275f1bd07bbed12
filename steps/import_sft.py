"""Step import-sft: validate an SFT checkpoint and publish it as v000000 of the run.

    python -m steps.import_sft --src URI --run URI [--run-config-json JSON]

The weights' dtype (float32, bfloat16 or float16, one for every tensor) is the run's: every version is
published in it. config.json must agree with the weights; when it declares no dtype, v000000's config.json
gets it (steps.models.checkpoint_validation.declare_dtype).

A checkpoint its family's publisher stores in a form moerl does not train is first rewritten, in the temporary
copy, as a plain float one (steps/models/import_conversions.py): gpt-oss's MXFP4 experts (the
Hub's gpt-oss-20b and -120b) are dequantized to bf16 with transformers' own arithmetic, which the step says in one
line; such a run then trains and publishes bf16.

Idempotent: a second call with the same checkpoint changes nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from steps import progress
from steps.errors import MoerlError, run_cli
from steps.models.checkpoint_validation import declare_dtype, refuse_pickled, validate_checkpoint_dir
from steps.models.hf_checkpoint import PICKLE_WEIGHT_SUFFIXES
from steps.models.import_conversions import convert_on_import
from steps.run import checkpoint
from steps.run.keys import RUN_CONFIG, version_name
from steps.store.object_store import Store


def fetch_checkpoint(src: Store, local_dir: Path, say: Callable[[str], None] = print) -> None:
    """Copy an HF checkpoint from any store URI: its top-level files, leaving pickled weight files and subfolders
    behind (a Hub repository's `original/` or `metal/` hold the same weights in another format)."""
    names = src.list()
    if not names:
        raise MoerlError(f"{src.uri}: no files there; point --src at an HF-format checkpoint directory")
    if "config.json" not in names:
        raise MoerlError(f"{src.uri}: missing config.json; an HF-format checkpoint directory is required")
    nested = sorted(name for name in names if "/" in name)
    if nested:
        folders = sorted({name.split("/")[0] + "/" for name in nested})
        say(f"{src.uri}: {len(nested)} files in subfolders ({', '.join(folders)}) not imported: a checkpoint's files "
            "are its top-level ones")  # fmt: skip
    names = [name for name in names if "/" not in name]
    refuse_pickled(names, src.uri)
    for name in names:
        if Path(name).suffix not in PICKLE_WEIGHT_SUFFIXES:
            (local_dir / name).parent.mkdir(parents=True, exist_ok=True)
            src.get_file(name, local_dir / name)


def write_run_config(run: Store, config_json: str) -> None:
    """run.json is written once; a different config for an existing run is refused, not overwritten."""
    try:
        config = json.loads(config_json)
    except ValueError as err:
        raise MoerlError(f"--run-config-json: not valid JSON ({err})") from err
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    if run.exists(RUN_CONFIG):
        if json.loads(run.get_bytes(RUN_CONFIG)) != config:
            raise MoerlError(
                f"{run.url(RUN_CONFIG)} already holds a different config; a run keeps its config — "
                "use a new run store URI for a new config"
            )
        return
    run.put_bytes(RUN_CONFIG, text.encode())


def import_sft(src_uri: str, run_uri: str, run_config_json: str | None = None) -> checkpoint.Manifest:
    src, run = Store.open(src_uri), Store.open(run_uri)
    src.check_access()
    run.check_access()
    progress.report(0, 2)
    with tempfile.TemporaryDirectory(prefix="moerl-import-") as tmp:
        local = Path(tmp)
        fetch_checkpoint(src, local)
        def say(line: str) -> None:
            print(line.replace(str(local), src.uri))

        try:
            convert_on_import(local, say)
            validate_checkpoint_dir(local, say=say)
            declare_dtype(local)
        except MoerlError as err:  # name the user's --src, not the temporary copy
            raise MoerlError(str(err).replace(str(local), src.uri)) from None
        progress.report(1, 2)
        if run_config_json is not None:
            write_run_config(run, run_config_json)
        manifest = checkpoint.publish_dir(run, local, version=0, parent=None, iteration=0)
    progress.report(2, 2)
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.import_sft", description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="SFT checkpoint: local dir, file:// or s3:// URI (HF format)")
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--run-config-json", help="resolved run config to store as <run>/run.json")
    args = parser.parse_args()
    manifest = import_sft(args.src, args.run, args.run_config_json)
    print(f"imported {args.src} as {version_name(manifest.version)} of {args.run} "
          f"({len(manifest.files)} files)")
    return 0


if __name__ == "__main__":
    run_cli(main)
