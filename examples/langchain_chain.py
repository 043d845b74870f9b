"""A LangChain chain on the rescaled model: prompt template, chat model, output parser.

pip install ".[langchain]" && python examples/langchain_chain.py
"""

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from rag_mspoe.connectors.langchain import ChatRagMsPoE

chat = ChatRagMsPoE(method="mspoe", max_tokens=48)
prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer briefly.")
chain = prompt | chat | StrOutputParser()
print(
    chain.invoke(
        {
            "context": "The Velmora lighthouse was built in 1903 by the engineer Arvid Lenn.",
            "question": "Who built the Velmora lighthouse?",
        }
    )
)
print(chat.invoke("Who built the Velmora lighthouse?", method="none").response_metadata)
