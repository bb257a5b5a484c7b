"""OpenAI's `developer` role renders as `system` when the chat template has no developer role (as OpenAI
and vLLM do), and stays `developer` for a template that names it (api/inference/sampling.py)."""

from __future__ import annotations

from transformers import AutoTokenizer

from api.inference.protocol import ChatCompletionRequest
from api.inference.sampling import encode_chat_prompt


def _ids(tokenizer, role: str) -> list[int]:
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    )
    return encode_chat_prompt(tokenizer, body, None, 4096)


def test_developer_renders_as_system(tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert "developer" not in tokenizer.chat_template
    assert _ids(tokenizer, "developer") == _ids(tokenizer, "system")


def test_a_template_with_a_developer_role_keeps_it(tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}{# developer #}"
    )
    assert tokenizer.decode(_ids(tokenizer, "developer")).startswith("[developer] Answer")
