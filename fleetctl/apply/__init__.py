"""Carrying plans out on the nodes: vLLM servers started, supervised, checked and stopped."""
