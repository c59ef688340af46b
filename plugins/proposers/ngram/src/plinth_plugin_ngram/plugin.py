"""Entry point: registers the ``ngram`` proposer and its options; imports nothing heavy."""

from plinth.api import ProposerDescriptor, hookimpl


@hookimpl
def plinth_register_proposers():
    return [
        ProposerDescriptor(
            name="ngram",
            impl="plinth_plugin_ngram.proposer:NgramProposer",
            priority=10,
            description="prompt lookup: copies what followed the longest recent n-gram match in the prompt and output (no model)",
        )
    ]


@hookimpl
def plinth_add_cli_arguments(parser):
    parser.add_argument("--ngram-min-n", type=int, default=None, metavar="N", help="ngram proposer: shortest n-gram matched (default 2)")
    parser.add_argument("--ngram-max-n", type=int, default=None, metavar="N", help="ngram proposer: longest n-gram matched (default 4)")
