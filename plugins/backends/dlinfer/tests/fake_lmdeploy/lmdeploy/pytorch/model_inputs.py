"""lmdeploy/pytorch/model_inputs.py: StepContext, get_step_ctx_manager."""


class StepContext:
    pass


def get_step_ctx_manager():
    raise NotImplementedError("not modelled: plinth builds its own step metadata")
