"""`marsched serve` picks the tool-call parser from the model when the user names none
(`marsched.serve.tool_parser`); the user's flags always win; the startup line says which
parser, and a warning naming the architecture says when none fits. Without vLLM, except the
last test (every parser named here is one the installed vLLM registers)."""

from __future__ import annotations

import json
import sys

import pytest

from marsched.bench.model import CHAT_TEMPLATE
from marsched.serve.launch import ServeOptions, serve, vllm_command
from marsched.serve.tool_parser import (
    HF_PARSER, RULES, ModelFacts, ParserChoice, choice_for, choose, read_model_facts, startup_text,
    vllm_tool_args, warning,
)

LLAMA = ("LlamaForCausalLM",)
QWEN2 = ("Qwen2ForCausalLM",)

# Template fragments as each family writes an assistant's tool calls (abridged).
HERMES = "{%- for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
QWEN3_CODER = "<tool_call>\n<function={{ c.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>"
GLM = "<tool_call>{{ c.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>"
LLAMA31 = "{{- '<|python_tag|>' + tool_call.name + '.call(' }}{{- '{\"name\": \"' + tool_call.name }}"
MISTRAL = "{{- '[TOOL_CALLS]' }}{{- tool_calls | tojson }}"
DEEPSEEK_V3 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'"
DEEPSEEK_V31 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.mark.parametrize("architectures, template, parser", [
    (QWEN2, HERMES, "hermes"),
    (("Qwen3MoeForCausalLM",), QWEN3_CODER, "qwen3_coder"),  # writes <tool_call> too
    (("Glm4MoeForCausalLM",), GLM, "glm47"),  # writes <tool_call> too
    (("SomeOtherForCausalLM",), GLM, "hermes"),  # <arg_key> alone is GLM only on its architecture
    (("Ernie4_5_MoeForCausalLM",), HERMES, "ernie45"),
    (("GraniteMoeHybridForCausalLM",), HERMES, "granite4"),
    (LLAMA, LLAMA31, "llama3_json"),
    (("MistralForCausalLM",), MISTRAL, "mistral"),
    (("DeepseekV3ForCausalLM",), DEEPSEEK_V3, "deepseek_v3"),
    (("DeepseekV3ForCausalLM",), DEEPSEEK_V31, "deepseek_v31"),
    (("GptOssForCausalLM",), PLAIN, "openai"),  # harmony: by architecture
    (("Llama4ForConditionalGeneration",), PLAIN, "llama4_pythonic"),
    (LLAMA, CHAT_TEMPLATE, "pythonic"),  # the model `marsched model` builds
])
def test_the_parser_is_the_one_that_reads_what_the_template_writes(architectures, template, parser):
    assert choose(ModelFacts(architectures, template)).parser == parser


def test_the_tokenizers_response_template_comes_first_unless_another_reasoning_parser_is_given():
    facts = ModelFacts(QWEN2, HERMES, response_template_tools=True)
    assert choose(facts).parser == HF_PARSER
    assert choose(facts, reasoning_parser=HF_PARSER).parser == HF_PARSER
    assert choose(facts, reasoning_parser="qwen3").parser == "hermes"  # vLLM's hf combines with no other


def test_when_none_fits_the_reason_names_the_architecture():
    plain = choose(ModelFacts(LLAMA, PLAIN))
    assert plain.parser is None and "LlamaForCausalLM" in plain.reason and "chat template" in plain.reason
    bare = choose(ModelFacts(LLAMA, None))
    assert bare.parser is None and bare.reason == "LlamaForCausalLM has no chat template"
    assert "unknown architecture" in choose(ModelFacts((), PLAIN)).reason
    said = warning(plain, ())
    assert said.startswith("marsched serve: warning: no tool-call parser fits") and "LlamaForCausalLM" in said
    assert "--tool-call-parser" in said
    assert warning(plain, ("--tool-call-parser", "hermes")) is None  # the user chose
    assert warning(choose(ModelFacts(QWEN2, HERMES)), ()) is None


def test_every_rule_can_win():
    """A rule shadowed by an earlier one would never be chosen."""
    for rule in RULES:
        template = "\n".join(rule.markers) or PLAIN
        assert choose(ModelFacts(rule.architectures or LLAMA, template)).parser == rule.parser, rule


def model_dir(tmp_path, architectures=LLAMA, name="model", **files):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    for name, content in files.items():
        (folder / name.replace("__", ".")).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


def test_facts_are_read_where_transformers_keeps_templates(tmp_path):
    model = model_dir(tmp_path, QWEN2, chat_template__jinja=HERMES)
    assert read_model_facts(model) == ModelFacts(QWEN2, HERMES)
    model = model_dir(tmp_path, QWEN2, "b", tokenizer_config__json={
        "chat_template": [{"name": "default", "template": PLAIN}, {"name": "tool_use", "template": HERMES}]})
    assert choice_for(model).parser == "hermes"  # the named tool_use template counts
    model = model_dir(tmp_path, QWEN2, "c", tokenizer_config__json={
        "chat_template": PLAIN, "response_template": {"fields": {"content": {}, "tool_calls": {}}}})
    assert read_model_facts(model).response_template_tools and choice_for(model).parser == HF_PARSER


def test_the_users_chat_template_and_tokenizer_are_read_instead(tmp_path):
    model = model_dir(tmp_path, LLAMA, chat_template__jinja=CHAT_TEMPLATE)
    (tmp_path / "mine.jinja").write_text(PLAIN)
    assert choice_for(model, ("--chat-template", str(tmp_path / "mine.jinja"))).parser is None
    assert choice_for(model, (f"--chat-template={HERMES}",)).parser == "hermes"  # the template itself
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "chat_template.jinja").write_text(MISTRAL)
    assert choice_for(model, ("--tokenizer", str(tmp_path / "tok"))).parser == "mistral"
    assert choice_for(str(tmp_path / "absent")) == ParserChoice(None, "unknown architecture has no chat template")


def test_the_users_flags_win():
    chosen = ParserChoice("hermes", "Hermes-style")
    assert vllm_tool_args(chosen, ()) == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    for given in (("--tool-call-parser", "mistral"), ("--tool-call-parser=mistral",), ("--tool_call_parser", "x")):
        assert vllm_tool_args(chosen, given) == []
    assert vllm_tool_args(chosen, ("--no-enable-auto-tool-choice",)) == ["--tool-call-parser", "hermes"]
    assert vllm_tool_args(chosen, ("--enable-auto-tool-choice",)) == ["--tool-call-parser", "hermes"]
    assert vllm_tool_args(ParserChoice(None, "none"), ()) == []
    assert startup_text(chosen, ()) == "tool-call parser hermes (Hermes-style), auto tool choice on"
    assert startup_text(chosen, ("--no-enable-auto-tool-choice",)).endswith("auto tool choice off")
    assert startup_text(chosen, ("--tool-call-parser", "mistral")) == (
        "tool-call parser mistral (given), auto tool choice off")
    assert startup_text(chosen, ("--tool-call-parser", "x", "--enable-auto-tool-choice")).endswith("on")


def test_the_vllm_command_carries_the_chosen_parser_before_the_users_options(tmp_path):
    model = model_dir(tmp_path, LLAMA, chat_template__jinja=CHAT_TEMPLATE)
    command = vllm_command(ServeOptions(model, vllm_args=("--enforce-eager",)))
    assert command[command.index("--tool-call-parser") + 1] == "pythonic"
    assert command.index("--enable-auto-tool-choice") < command.index("--enforce-eager") == len(command) - 1
    given = vllm_command(ServeOptions(model, vllm_args=("--tool-call-parser", "hermes")))
    assert given.count("--tool-call-parser") == 1 and given[-2:] == ["--tool-call-parser", "hermes"]
    assert "--enable-auto-tool-choice" not in given
    assert "--tool-call-parser" not in vllm_command(ServeOptions(model_dir(tmp_path, LLAMA, "plain", chat_template__jinja=PLAIN)))


def test_the_startup_line_names_the_parser_and_a_warning_says_when_none_fits(tmp_path):
    python = tmp_path / "python"  # serve runs `python -m vllm...`: this one exits at once
    python.write_text(f"#!{sys.executable}\nimport sys; sys.exit(3)\n")
    python.chmod(0o755)
    model = model_dir(tmp_path, LLAMA, chat_template__jinja=CHAT_TEMPLATE)
    said: list[str] = []
    assert serve(ServeOptions(model, port=0, swap=False), echo=said.append, python=str(python), grace_s=5) == 3
    assert "tool-call parser pythonic (the chat template of `marsched model`), auto tool choice on" in said[0]
    (tmp_path / "model" / "chat_template.jinja").write_text(PLAIN)
    said.clear()
    serve(ServeOptions(model, port=0, swap=False), echo=said.append, python=str(python), grace_s=5)
    assert said[0].startswith("marsched serve: warning: no tool-call parser fits this model (LlamaForCausalLM")
    assert "no tool-call parser (chats with tools get HTTP 400)" in said[1]


@pytest.mark.vllm
def test_every_parser_chosen_is_one_vllm_registers():
    pytest.importorskip("vllm")
    from vllm.tool_parsers import _TOOL_PARSERS_TO_REGISTER

    chosen = {rule.parser for rule in RULES} | {"pythonic", HF_PARSER}
    assert chosen <= set(_TOOL_PARSERS_TO_REGISTER), sorted(chosen - set(_TOOL_PARSERS_TO_REGISTER))
