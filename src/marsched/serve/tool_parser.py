"""The tool-call parser `marsched serve` gives vLLM when the user names none.

vLLM answers a chat completion with `tools` only when told how to read the model's calls
(`--enable-auto-tool-choice --tool-call-parser NAME`); without them "auto" and named
`tool_choice` get HTTP 400. A parser fits a model when the model's chat template writes tool
calls the way the parser reads them, so the choice is made from the template's markers
(`<tool_call>` for hermes, `[TOOL_CALLS]` for mistral, ...) and the model's architecture
where two families share a marker (`RULES`, first match wins), for the families vLLM 0.32
has parsers for. Two more sources come first: a tokenizer that ships `response_template`
metadata with a `tool_calls` field fits vLLM's generic `hf` parser, and the model
`marsched model` builds (its template writes `[name(key="value")]`) fits `pythonic`.

`choose` is the pure decision; `read_model_facts` gathers what it reads from a model
directory, the local Hugging Face cache, or (`download=True`, in `marsched serve` only) the
Hub; `vllm_tool_args` turns a choice into vLLM options. A user's `--tool-call-parser` always
wins; a user's `--[no-]enable-auto-tool-choice` is kept, and auto tool choice is turned on
with a chosen parser otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from marsched.bench.model import CHAT_TEMPLATE as MARSCHED_MODEL_TEMPLATE

PARSER_OPTION = "--tool-call-parser"
AUTO_OPTIONS = ("--enable-auto-tool-choice", "--no-enable-auto-tool-choice")
HF_PARSER = "hf"  # vLLM's parser driven by the tokenizer's `response_template` metadata


@dataclass(frozen=True, slots=True)
class Rule:
    """A parser fits a model whose chat template holds every one of `markers` and, when
    `architectures` is not empty, whose architecture is one of them."""

    parser: str
    markers: tuple[str, ...]
    architectures: tuple[str, ...] = ()
    family: str = ""  # said on the startup line

    def fits(self, architectures: tuple[str, ...], template: str) -> bool:
        return (all(marker in template for marker in self.markers)
                and (not self.architectures or any(a in self.architectures for a in architectures)))


# The markers are the ones each parser reads (vllm/tool_parsers/*, vllm/parser/*); a family whose
# marker another family also writes comes first, with its architecture.
RULES: tuple[Rule, ...] = (
    Rule("openai", (), ("GptOssForCausalLM",), "gpt-oss (harmony)"),
    Rule("llama4_pythonic", (), ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), "Llama 4"),
    Rule("qwen3_coder", ("<tool_call>", "<function=", "<parameter="), (), "Qwen3-Coder XML calls"),
    Rule("minimax_m2", ("<minimax:tool_call>",), (), "MiniMax-M2"),
    Rule("seed_oss", ("<seed:tool_call>",), (), "Seed-OSS"),
    Rule("glm47", ("<tool_call>", "<arg_key>"), ("Glm4MoeForCausalLM",), "GLM-4.5/4.7"),
    Rule("kimi_k2", ("<|tool_calls_section_begin|>",), (), "Kimi K2"),
    Rule("deepseek_v32", ("DSML｜function_calls",), (), "DeepSeek-V3.2"),
    Rule("deepseek_v3", ("<｜tool▁calls▁begin｜>", "```json"), (), "DeepSeek-V3"),
    Rule("deepseek_v31", ("<｜tool▁calls▁begin｜>",), (), "DeepSeek-V3.1"),
    Rule("step3", ("<｜tool_calls_begin｜>",), (), "Step3"),
    Rule("mistral", ("[TOOL_CALLS]",), (), "Mistral"),
    Rule("llama3_json", ("<|python_tag|>",), (), "Llama 3.1-3.3 JSON calls"),
    Rule("granite", ("<|tool_call|>",), (), "Granite 3"),
    Rule("granite4", ("<tool_call>",), ("GraniteMoeHybridForCausalLM",), "Granite 4"),
    Rule("ernie45", ("<tool_call>",), ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"), "ERNIE 4.5"),
    Rule("hunyuan_a13b", ("<tool_calls>",), ("HunYuanMoEV1ForCausalLM",), "Hunyuan-A13B"),
    Rule("jamba", ("<tool_calls>",), ("JambaForCausalLM",), "Jamba"),
    Rule("olmo3", ("<function_calls>",), ("Olmo3ForCausalLM",), "OLMo 3"),
    Rule("internlm", ("<|plugin|>",), (), "InternLM2"),
    Rule("phi4_mini_json", ("functools[",), (), "Phi-4-mini"),
    Rule("lfm2", ("<|tool_call_start|>",), (), "LFM2"),
    Rule("functiongemma", ("<start_function_call>",), (), "FunctionGemma"),
    Rule("gemma4", ("<|tool_call>",), (), "Gemma 4"),
    Rule("longcat", ("<longcat_tool_call>",), (), "LongCat"),
    Rule("dots", ("<dots_function_call>",), (), "dots"),
    Rule("apertus", ("<|tools_prefix|>",), (), "Apertus"),
    Rule("hermes", ("<tool_call>",), (), "Hermes-style <tool_call> JSON (Qwen2.5, Qwen3, Hermes)"),
)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the choice reads of a model: its architectures (config.json), its chat template
    (all of its named templates, joined), and whether its tokenizer's `response_template`
    metadata has a `tool_calls` field."""

    architectures: tuple[str, ...] = ()
    chat_template: str | None = None
    response_template_tools: bool = False


@dataclass(frozen=True, slots=True)
class ParserChoice:
    parser: str | None  # None: no parser fits
    reason: str  # why, for the startup line or the warning

    def describe(self) -> str:
        return f"tool-call parser {self.parser} ({self.reason})" if self.parser else "no tool-call parser"


def choose(facts: ModelFacts, reasoning_parser: str | None = None) -> ParserChoice:
    """The parser that reads the tool calls this model writes, or a choice of None saying why
    none does. `reasoning_parser`: the user's; vLLM's `hf` parser combines with no other."""
    arch = ", ".join(facts.architectures) or "unknown architecture"
    if facts.response_template_tools and reasoning_parser in (None, "", HF_PARSER):
        return ParserChoice(HF_PARSER, "the tokenizer's response_template metadata")
    template = facts.chat_template
    if template is not None and template.strip() == MARSCHED_MODEL_TEMPLATE.strip():
        return ParserChoice("pythonic", "the chat template of `marsched model`")
    for rule in RULES:
        if rule.fits(facts.architectures, template or ""):
            return ParserChoice(rule.parser, f"{rule.family}: {arch}")
    if template is None:
        return ParserChoice(None, f"{arch} has no chat template")
    return ParserChoice(None, f"{arch}: its chat template writes tool calls in no form a vLLM parser "
                              "that marsched knows reads")


def choice_for(model: str, vllm_args: tuple[str, ...] = (), download: bool = False) -> ParserChoice:
    """`choose` for `model` served with `vllm_args` (`read_model_facts`)."""
    return choose(read_model_facts(model, vllm_args, download), option_value(vllm_args, "--reasoning-parser"))


def option_value(args: tuple[str, ...] | list[str], name: str) -> str | None:
    """The last value given to `name` in vLLM's arguments (`--name V` or `--name=V`; vLLM also
    takes `_` for `-` in names), or None."""
    value = None
    for index, arg in enumerate(args):
        given, equals, text = arg.partition("=")
        if _normal(given) == name:
            value = text if equals else (args[index + 1] if index + 1 < len(args) else None)
    return value


def _normal(option: str) -> str:
    return "--" + option[2:].replace("_", "-") if option.startswith("--") else option


def user_parser(vllm_args: tuple[str, ...]) -> str | None:
    return option_value(vllm_args, PARSER_OPTION)


def user_auto(vllm_args: tuple[str, ...]) -> bool | None:
    """The user's `--enable-auto-tool-choice` (True) or `--no-enable-auto-tool-choice` (False),
    the last one given, or None."""
    said = None
    for arg in vllm_args:
        name = _normal(arg.split("=", 1)[0])
        if name in AUTO_OPTIONS:
            said = name == AUTO_OPTIONS[0]
    return said


def vllm_tool_args(choice: ParserChoice, vllm_args: tuple[str, ...]) -> list[str]:
    """The options to add to vLLM's: none when the user named a parser or none fits; else the
    parser, and auto tool choice unless the user said either way."""
    if choice.parser is None or user_parser(vllm_args) is not None:
        return []
    args = [PARSER_OPTION, choice.parser]
    if user_auto(vllm_args) is None:
        args.append(AUTO_OPTIONS[0])
    return args


def startup_text(choice: ParserChoice, vllm_args: tuple[str, ...]) -> str:
    """The startup line's part about tool calls."""
    given = user_parser(vllm_args)
    auto = user_auto(vllm_args)
    if given is not None:
        return f"tool-call parser {given} (given), auto tool choice {'on' if auto else 'off'}"
    if choice.parser is None:
        return "no tool-call parser (chats with tools get HTTP 400)"
    return f"{choice.describe()}, auto tool choice {'off' if auto is False else 'on'}"


def warning(choice: ParserChoice, vllm_args: tuple[str, ...]) -> str | None:
    """The warning line when no parser fits and the user named none."""
    if choice.parser is not None or user_parser(vllm_args) is not None:
        return None
    return (f"marsched serve: warning: no tool-call parser fits this model ({choice.reason}); "
            "chat completions with tools will get HTTP 400. Give vLLM's --enable-auto-tool-choice "
            "--tool-call-parser NAME (after --) if the model calls tools")


# --- reading a model -------------------------------------------------------------------------

def read_model_facts(model: str, vllm_args: tuple[str, ...] = (), download: bool = False) -> ModelFacts:
    """The facts of `model` (a directory or a Hugging Face repository id) as vLLM will serve it:
    the chat template of `--chat-template` (a file or the template itself) if given, else of
    `--tokenizer` if given, else the model's. A repository is read from the local Hugging Face
    cache, or downloaded (its small config files only) when `download`. Unreadable files count
    as absent."""
    config = _json(_model_file(model, "config.json", download)) or {}
    architectures = tuple(a for a in config.get("architectures") or () if isinstance(a, str))
    tokenizer = option_value(vllm_args, "--tokenizer") or model
    tokenizer_config = _json(_model_file(tokenizer, "tokenizer_config.json", download)) or {}
    given = option_value(vllm_args, "--chat-template")
    if given is not None:
        template: str | None = _text(Path(given)) if os.path.isfile(given) else given
    else:
        template = _chat_template(tokenizer, tokenizer_config, download)
    response = tokenizer_config.get("response_template")
    fields = response.get("fields") if isinstance(response, dict) else None
    return ModelFacts(architectures, template, isinstance(fields, dict) and "tool_calls" in fields)


def _chat_template(tokenizer: str, tokenizer_config: dict, download: bool) -> str | None:
    """Every chat template the tokenizer has (transformers reads chat_template.jinja,
    chat_template.json, then tokenizer_config.json; a list there holds named templates), joined."""
    texts: list[str] = []
    jinja = _model_file(tokenizer, "chat_template.jinja", download)
    if jinja is not None:
        texts.append(_text(jinja) or "")
    stored = (_json(_model_file(tokenizer, "chat_template.json", download)) or {}).get("chat_template")
    for source in (stored, tokenizer_config.get("chat_template")):
        if isinstance(source, str):
            texts.append(source)
        elif isinstance(source, list):
            texts += [t.get("template", "") for t in source if isinstance(t, dict)]
    joined = "\n".join(t for t in texts if t)
    return joined or None


def _model_file(model: str, name: str, download: bool) -> Path | None:
    if os.path.isdir(model):
        path = Path(model) / name
        return path if path.is_file() else None
    try:
        import huggingface_hub
    except ImportError:
        return None
    try:
        cached = huggingface_hub.try_to_load_from_cache(model, name)
    except Exception:  # not a repository id, say
        return None
    if isinstance(cached, str):
        return Path(cached)
    if not download or cached is not None or "/" not in model:  # cached: a "known absent" marker
        return None  # (only an "owner/name" id is downloaded: "m" in a test is nobody's model)
    try:
        return Path(huggingface_hub.hf_hub_download(model, name, etag_timeout=10))
    except Exception:  # absent, offline, gated, ...: vLLM says what is wrong when it loads the model
        return None


def _text(path: Path | None) -> str | None:
    try:
        return path.read_text() if path is not None else None
    except (OSError, UnicodeDecodeError):
        return None


def _json(path: Path | None) -> dict | None:
    text = _text(path)
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
