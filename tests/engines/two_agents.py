"""Two agents for one DBOS system database (tests/engines/test_dbos_versions.py): `alpha` and `beta`, each answering
`'<name> answered: <prompt>'` through a scripted `FunctionModel` (no provider). `DURCAP_TWO_AGENTS_TAG` suffixes
both names, so concurrent tests do not share workflows."""

import os

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

TAG = os.environ.get('DURCAP_TWO_AGENTS_TAG', '')


def _answering(name: str) -> FunctionModel:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        prompt = next(p.content for m in reversed(messages) for p in getattr(m, 'parts', [])
                      if isinstance(p, UserPromptPart))
        return ModelResponse(parts=[TextPart(f'{name} answered: {prompt}')])

    return FunctionModel(answer)


alpha = DurableAgent(f'alpha{TAG}', _answering('alpha'))
beta = DurableAgent(f'beta{TAG}', _answering('beta'))
