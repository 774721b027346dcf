"""A loss that is NaN/inf stops the run with the step number and the last finite loss."""

from apprun import TINY
from parity import Case, Probe, run_cases, session_dir


class TrainingStops(Probe):
    """The `TrainingError` that stopped `trainer.train()` (its message, or None) and the step it stopped at."""

    name = "stopped"

    def attach(self, trainer) -> None:
        from mmfsdp.train.trainer import TrainingError

        train, self.message = trainer.train, None

        def guarded():
            try:
                train()
            except TrainingError as err:
                self.message = str(err)

        trainer.train = guarded

    def result(self, trainer) -> dict:
        return {"message": self.message, "step": trainer.step}


CASE = Case("overflow", 1, TINY, {
    "training.micro_batch_size": 4,
    "training.train_iters": 6,
    "training.lr": 1.0e30,  # one AdamW step moves every weight by ~lr: the next loss overflows
    "training.lr_min": 0.0,
    "training.lr_decay_style": "constant",
}, dataset="shapes", probes=(TrainingStops,))


def test_non_finite_loss_stops_with_step_and_last_finite_loss(tmp_path, tmp_path_factory):
    result = run_cases([CASE], tmp_path, session_dir(tmp_path_factory), 300)["overflow"]
    stopped = result["stopped"][0]
    assert stopped["message"] is not None, "the run should have stopped"
    failed_at = stopped["step"] + 1
    assert f"is not finite at step {failed_at}" in stopped["message"]
    assert f"last finite loss {result['steps'][-1][0]:.6f} at step {stopped['step']}" in stopped["message"]
