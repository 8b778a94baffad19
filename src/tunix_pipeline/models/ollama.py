"""An Ollama `Modelfile` beside each exported GGUF file: FROM the file, the chat template as Ollama's Go template
(found by rendering conversations with marker contents), and its stop strings."""

from __future__ import annotations

import json

from tunix_pipeline.core.errors import ModelError


def modelfile(gguf_name: str, tokenizer, template: str | None, add_bos: bool) -> str:
    """An Ollama Modelfile: FROM the file, the chat template as Ollama's Go template, and stop strings."""
    lines = [f"FROM ./{gguf_name}"]
    if template:
        turns = chat_turns(tokenizer, template, add_bos)
        lines.append(f'TEMPLATE """{go_template(turns)}"""')
        stops = [turns["assistant"][1].strip(), tokenizer.eos_token]
        lines += [f"PARAMETER stop {json.dumps(s, ensure_ascii=False)}" for s in dict.fromkeys(stops) if s]
    return "\n".join(lines) + "\n"


def chat_turns(tokenizer, template: str, add_bos: bool) -> dict:
    """The template's text around each role's content ({role: (before, after)}), the text that opens a
    conversation and the generation prompt, found by rendering conversations with marker contents.
    "system" is None when the template folds the system prompt into the first user turn (Gemma's)."""

    def render(*roles, generation=False):
        messages = [{"role": role, "content": MARKERS[role + str(n)]} for role, n in roles]
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation
        )

    bos = tokenizer.bos_token if add_bos and tokenizer.bos_token else None
    try:
        three_turns = render(("user", 1), ("assistant", 1), ("user", 2))
        head, after_u1, after_a1, after_u2 = _split(three_turns, ["user1", "assistant1", "user2"])
        assistant_after = _split(render(("user", 1), ("assistant", 1)), ["user1", "assistant1"])[-1]
        prompt = render(("user", 1))
        generation = render(("user", 1), generation=True)[len(prompt):]
    except Exception as err:  # e.g. a template that raises on a plain user/assistant conversation
        raise ModelError(f"GGUF export: the chat template cannot be turned into an Ollama TEMPLATE: {err}") from err
    user_before = after_a1[len(assistant_after):]
    if not (after_a1.startswith(assistant_after) and after_u1.startswith(after_u2) and head.endswith(user_before)):
        raise ModelError("GGUF export: the chat template renders the turns of one role differently; "
                         "Ollama's TEMPLATE cannot follow it: set export.formats: [hf]")

    def without_bos(text: str) -> str:  # llama.cpp adds BOS itself (tokenizer.ggml.add_bos_token)
        return text[len(bos):] if bos and text.startswith(bos) else text

    turns = {
        "opening": without_bos(head[: len(head) - len(user_before)]),
        "system": None,
        "user": (user_before, after_u2),
        "assistant": (after_u1[len(after_u2):], assistant_after),
        "generation": generation,
    }
    try:
        system_head, between, _ = _split(render(("system", 1), ("user", 1)), ["system1", "user1"])
    except Exception:  # a template without a system role
        return turns
    if between.endswith(user_before):
        turns["system"] = (without_bos(system_head), between[: len(between) - len(user_before)])
    return turns


MARKERS = {f"{role}{n}": f"\x01{role}{n}\x01" for role in ("system", "user", "assistant") for n in (1, 2)}


def _split(text: str, markers: list[str]) -> list[str]:
    """The text around the markers' contents (in order): len(markers) + 1 pieces."""
    pieces = []
    for marker in markers:
        before, found, text = text.partition(MARKERS[marker])
        if not found:
            raise ValueError(f"the rendered template lost the content of {marker}")
        pieces.append(before)
    return pieces + [text]


def go_template(turns: dict) -> str:
    """Ollama's TEMPLATE over .Messages; every literal a quoted Go string, which whitespace trimming never touches."""

    def q(s: str) -> str:
        return "{{ " + json.dumps(s, ensure_ascii=False) + " }}" if s else ""

    (ub, ua), (ab, aa) = turns["user"], turns["assistant"]
    sb, sa = turns["system"] or turns["user"]
    opening = q(turns["opening"])
    if opening and turns["system"]:  # a system message replaces the opening text (e.g. a default system prompt)
        opening = '{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}' + opening + "{{ end }}"
    return "\n".join([
        opening,
        "{{- range $i, $_ := .Messages }}",
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
        '{{- if eq .Role "system" }}' + q(sb) + "{{ .Content }}" + q(sa),
        '{{- else if eq .Role "user" }}' + q(ub) + "{{ .Content }}" + q(ua)
        + "{{ if $last }}" + q(turns["generation"]) + "{{ end }}",
        '{{- else if eq .Role "assistant" }}' + q(ab) + "{{ .Content }}{{ if not $last }}" + q(aa) + "{{ end }}",
        "{{- end }}",
        "{{- end }}",
    ]).lstrip("\n")
