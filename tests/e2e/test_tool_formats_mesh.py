"""Tool calls in a model family's own format over the whole mesh, the format picked from
the chat template as a user's model brings it (no flag): Llama 3's JSON and GLM's
<arg_key>/<arg_value> tags. tool_choice "required" and a named tool, stream and not, over
PD (prefill samples the first token under the grammar, decode goes on under the same one,
the format crossing in the job's Constraint) give well-formed calls whose arguments
validate, and the stream equals the whole answer."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdmesh.local.cluster import Cluster

from .conftest import DET, det_overrides
from .test_tools_http import MAX, SCHEMAS, TOOLS, USER, check_calls, streamed

# Minimal templates in each family's style: tools described, calls rendered back in the
# format the model writes (what detect() reads)
LLAMA3 = """{%- for m in messages -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>
{% if m.tool_calls %}{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", \
"parameters": {{ tc.function.arguments }}}{% endfor %}{% else %}{{ m.content }}{% endif %}\
<|eot_id|>{% endfor %}{% if tools %}<|start_header_id|>ipython<|end_header_id|>Answer with \
{"name": function name, "parameters": dictionary of arguments}. {{ tools | tojson }}<|eot_id|>\
{% endif %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""
GLM = """{%- if tools %}[gMASK]<sop><|system|>Tools: {{ tools | tojson }}. Call one as \
<tool_call>name
<arg_key>key</arg_key>
<arg_value>value</arg_value>
</tool_call>{% endif %}{% for m in messages %}<|{{ m.role }}|>
{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}\
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
TEMPLATES = {"llama3_json": LLAMA3, "glm45": GLM}
OPENS = {"llama3_json": '{"name": ', "glm45": "<tool_call>"}     # how the raw output begins


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def client(fmt, tiny_target, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / f"{fmt}.jinja"
    path.write_text(TEMPLATES[fmt])
    overrides = det_overrides() | {"gateway": {"chat_template": str(path)}}
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET, overrides=overrides,
                 echo=False) as c:
        yield openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0,
                            timeout=60)


def create(client, **kw):
    return client.chat.completions.with_raw_response.create(**(
        {"model": "tiny-target", "messages": USER, "tools": TOOLS, "max_tokens": MAX,
         "temperature": 0} | kw))


@pytest.mark.parametrize("choice,only", [
    ("required", None), ({"type": "function", "function": {"name": "set_alarm"}}, "set_alarm")])
def test_a_forced_call_in_the_models_format_over_pd(client, fmt, tiny_target, choice, only):
    from transformers import AutoTokenizer

    raw = create(client, tool_choice=choice, parallel_tool_calls=False,
                 extra_headers={"x-pdmesh-path": "pd"}, extra_body={"return_token_ids": True})
    assert raw.headers["x-pdmesh-path"] == "pd"
    ch = raw.parse().choices[0]
    text = AutoTokenizer.from_pretrained(tiny_target).decode(ch.model_extra["token_ids"])
    assert text.startswith(OPENS[fmt]), text         # the model wrote the family's format
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    whole = check_calls(ch.message.tool_calls, only, single=True)
    calls, content, finish = streamed(client, tool_choice=choice, parallel_tool_calls=False)
    assert content == "" and finish == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == whole
    for name, args in whole:
        jsonschema.validate(args, SCHEMAS[name])
