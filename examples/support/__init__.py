"""The seed's support agent as a DurableAgent; see agent.py and scripted.py."""
