"""Entry point: registers the ``draft`` proposer; imports nothing heavy."""

from plinth.api import ProposerDescriptor, hookimpl


@hookimpl
def plinth_register_proposers():
    return [
        ProposerDescriptor(
            name="draft",
            impl="plinth_plugin_draft.proposer:DraftProposer",
            priority=5,
            description="a smaller model of the same tokenizer (--speculative-model), run greedily by the core with its own paged KV cache",
        )
    ]
