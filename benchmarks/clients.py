"""Real clients against an OpenAI-compatible server: the ten structured-output and tool cases of
issue 48 (the openai SDK, instructor, LangChain, `llm --schema`), each passed or failed with the
reason. Not part of the suite (the clients are not specli's dependencies):

    python -m venv /tmp/clients && /tmp/clients/bin/pip install openai instructor langchain-openai llm
    specli serve -m QWEN_TARGET -d QWEN_DRAFT --port 8080 &      # or llama-server --jinja ...
    /tmp/clients/bin/python benchmarks/clients.py http://127.0.0.1:8080

Greedy (temperature 0) everywhere; each case checks the shape a client needs (a call with the
right name and arguments, an object that validates), not the model's wording.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int
    city: str


PERSON_TEXT = "Maria Lopez is 34 and lives in Valencia."
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def main(base: str) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def person_ok(p) -> None:
        p = p if isinstance(p, dict) else p.model_dump()
        assert p["name"] == "Maria Lopez" and p["age"] == 34 and "Valencia" in p["city"], p

    def tool_call():
        r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=120)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris", r
        return r

    def streamed_tool_call():
        name, args = None, ""
        for chunk in client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=120, stream=True):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = call.function.name or name
                args += call.function.arguments or ""
        assert name == "get_weather" and json.loads(args)["city"] == "Paris", (name, args)

    def round_trip():
        r = tool_call()
        call = r.choices[0].message.tool_calls[0]
        messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}]
        r2 = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=80)
        assert r2.choices[0].message.content or r2.choices[0].message.tool_calls, r2

    def json_schema():
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Extract the person as JSON: {PERSON_TEXT}"}], temperature=0,
                                           max_tokens=100, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}})
        person_ok(json.loads(r.choices[0].message.content))

    def json_object():
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Give name, age and city as a JSON object: {PERSON_TEXT}"}],
                                           temperature=0, max_tokens=100, response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)

    def instructor_mode(mode_name: str):
        import instructor

        patched = instructor.from_openai(openai.OpenAI(base_url=f"{base}/v1", api_key="none"), mode=getattr(instructor.Mode, mode_name))
        person_ok(patched.chat.completions.create(model=model, response_model=Person, temperature=0, max_tokens=120, max_retries=0,
                                                  messages=[{"role": "user", "content": f"Extract: {PERSON_TEXT}"}]))

    def langchain_structured():
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=model, temperature=0, max_tokens=120)
        person_ok(llm.with_structured_output(Person).invoke(f"Extract: {PERSON_TEXT}"))

    def langchain_tools():
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        @tool
        def get_weather(city: str) -> str:
            """Current weather for a city."""
            return "cloudy"

        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=model, temperature=0, max_tokens=120)
        out = llm.bind_tools([get_weather]).invoke("What is the weather in Paris right now?")
        assert out.tool_calls and out.tool_calls[0]["name"] == "get_weather" and out.tool_calls[0]["args"]["city"] == "Paris", out

    def llm_schema():
        with tempfile.TemporaryDirectory() as home:
            with open(os.path.join(home, "extra-openai-models.yaml"), "w") as f:
                f.write(f"- model_id: local\n  model_name: {model}\n  api_base: {base}/v1\n  supports_schema: true\n")
            exe = os.path.join(os.path.dirname(sys.executable), "llm")
            out = subprocess.run([exe, "-m", "local", "--schema", "name, age int, city", "-o", "temperature", "0", f"Extract: {PERSON_TEXT}"],
                                 capture_output=True, text=True, timeout=300, env={**os.environ, "LLM_USER_PATH": home, "OPENAI_API_KEY": "none"})
            assert out.returncode == 0, out.stderr[-500:]
            person_ok(json.loads(out.stdout))

    cases = [("openai: tool call", tool_call), ("openai: streamed tool call", streamed_tool_call), ("openai: tool round trip", round_trip),
             ("openai: response_format json_schema", json_schema), ("openai: response_format json_object", json_object),
             ("instructor: TOOLS", lambda: instructor_mode("TOOLS")), ("instructor: JSON_SCHEMA", lambda: instructor_mode("JSON_SCHEMA")),
             ("langchain: with_structured_output", langchain_structured), ("langchain: bind_tools", langchain_tools), ("llm --schema", llm_schema)]
    passed = 0
    for name, case in cases:
        try:
            case()
            passed += 1
            print(f"pass  {name}")
        except Exception as err:  # a client's failure is the figure
            print(f"FAIL  {name}: {type(err).__name__}: {' '.join(str(err).split())[:300]}")
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
    print(f"{passed} of {len(cases)} passed ({base}, model {model})")
    return 0 if passed == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].rstrip("/") if len(sys.argv) > 1 else "http://127.0.0.1:8080"))
