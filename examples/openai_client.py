"""Talk to `rag-mspoe serve` with the OpenAI client; the model name picks the method.

rag-mspoe serve &           # http://127.0.0.1:8000/v1
python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
for model in ("smollm2-135m-instruct+none", "smollm2-135m-instruct+mspoe"):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three sea animals."}],
        max_tokens=32,
        temperature=0,
    )
    print(f"{model}: {reply.choices[0].message.content}")
