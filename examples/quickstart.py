"""Ask the embedded model a question about documents packed in retrieval order, with and without Ms-PoE.

python examples/quickstart.py
"""

from rag_mspoe import MsPoE, load_model, method_name, rescaled
from rag_mspoe.engine import Engine

DOCUMENTS = [
    "The Harbour Lantern Festival of Velmora began in 1871, when fishermen hung lamps on the pier.",
    "Velmora's old tram line closed in 1962 and its depot became the town library.",
    "The festival's founder, the netmaker Ilse Marrow, chose the date of the first spring tide.",
    "Velmora exports salted cod and hand-knitted sweaters to the mainland.",
    "The town council meets every second Tuesday in the former customs house.",
]
QUESTION = "Who founded the Harbour Lantern Festival?"

model, tokenizer = load_model()  # SmolLM2-135M-Instruct, converted once into the cache
engine = Engine(model, tokenizer)
context = "\n".join(f"Document [{i}](Title: Velmora) {text}" for i, text in enumerate(DOCUMENTS, 1))
prompt = (
    "Write a high-quality answer for the given question using only the provided search results "
    f"(some of which might be irrelevant).\n\n{context}\n\nQuestion: {QUESTION}\nAnswer:"
)
for method in (None, MsPoE()):
    with rescaled(model, method):
        answer = engine.generate(prompt, max_new_tokens=32)
    print(f"{method_name(method):>6}: {answer.text}")
