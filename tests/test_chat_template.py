"""render_chat_template: transformers' Jinja settings, message checks, end-of-turn tokens."""

import datetime
import subprocess
import sys

import pytest

from paged_jax.core.chat_template import end_of_turn_token, render_chat_template, validate_messages

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# Llama-3 style: bos_token, a namespace, tojson, loop controls and block tags on their own lines
# (trim_blocks / lstrip_blocks decide the whitespace).
LLAMA3_LIKE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ('user', 'assistant') %}
        {{ raise_exception('role ' + message['role'] + ' is not supported') }}
    {% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|eot_id|>
{% endfor %}
{% if ns.system %}system={{ ns.system | tojson }}{% endif %}
{% if tools is not none %}tools={{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
MULTI_TURN = [{"role": "system", "content": "Be brief & use <b>tags</b>."},
              {"role": "user", "content": "  Hi, café?  "},
              {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Bye"}]


def test_imports_no_jax():
    code = ("import sys\nimport paged_jax.core.chat_template\n"
            "assert 'jax' not in sys.modules, 'importing paged_jax.core.chat_template imported jax'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_chatml():
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat_template(CHATML, messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(CHATML, messages, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert end_of_turn_token(CHATML) == "<|im_end|>"


def test_block_whitespace_namespace_tojson_loopcontrols_generation():
    text = render_chat_template(LLAMA3_LIKE, MULTI_TURN, bos_token="<s>")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it;
    # tojson keeps '<', '&' and non-ASCII as they are (Jinja's own filter would escape them).
    assert text == ("<s>\n<|start_header_id|>user<|end_header_id|>\n\nHi, café?<|eot_id|>\n"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\n"
                    "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\n"
                    'system="Be brief & use <b>tags</b>."<|start_header_id|>assistant<|end_header_id|>\n\n')
    tools = [{"name": "f", "description": "<x>"}]
    assert 'tools=[{"name": "f", "description": "<x>"}]' in render_chat_template(LLAMA3_LIKE, MULTI_TURN, tools=tools)
    assert end_of_turn_token(LLAMA3_LIKE) == "<|eot_id|>"


def test_raise_exception_and_sandbox_become_value_errors():
    with pytest.raises(ValueError, match="role tool is not supported"):
        render_chat_template(LLAMA3_LIKE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
    with pytest.raises(ValueError, match="chat template failed"):  # immutable sandbox
        render_chat_template("{% set _ = messages.append(1) %}", [])
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat_template("{% for %}", [])


def test_strftime_now_and_extra_variables():
    today = datetime.datetime.now().strftime("%Y")
    assert render_chat_template("{{ strftime_now('%Y') }} {{ date }}", [], date="x") == f"{today} x"


def test_messages_are_validated_and_not_mutated():
    messages = [{"role": "user", "content": "a"}]
    render_chat_template("{% set m = messages[0] %}{{ m['content'] }}", messages)
    assert messages == [{"role": "user", "content": "a"}]
    assert validate_messages(messages) == messages and validate_messages(messages)[0] is not messages[0]
    bad = [("hello", "must be a list"),
           ({"role": "user", "content": "x"}, "must be a list"),
           ([{"role": "user", "content": "x"}, "hi"], r"messages\[1\] must be a dict"),
           ([{"role": "user"}], r"messages\[0\] has no 'content'"),
           ([{"content": "x"}], r"messages\[0\] has no 'role'"),
           ([{"role": "user", "content": "x"}, {"role": "user", "content": None}],
            r"messages\[1\]\['content'\] must be a str, got NoneType"),
           ([{"role": 1, "content": "x"}], r"messages\[0\]\['role'\] must be a str")]
    for messages, match in bad:
        with pytest.raises(ValueError, match=match):
            render_chat_template(CHATML, messages)
    with pytest.raises(ValueError, match="non-empty chat template"):
        render_chat_template("", [{"role": "user", "content": "x"}])


def test_end_of_turn_token_unknown():
    assert end_of_turn_token("{{ messages[0]['content'] }}") is None


@pytest.mark.hf
@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE], ids=["chatml", "llama3_like"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(template, add_generation_prompt):
    chat_template_utils = pytest.importorskip(
        "transformers.utils.chat_template_utils", reason="the reference needs transformers (pip install -e '.[hf]')")
    for messages in (MULTI_TURN[1:2], MULTI_TURN):
        want, _ = chat_template_utils.render_jinja_template(
            conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt,
            bos_token="<s>", eos_token="</s>")
        got = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                   bos_token="<s>", eos_token="</s>")
        assert got == want[0]
