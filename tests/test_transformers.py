"""Hugging Face models as they are, with no wrapper: a tiny GPT-2 and a tiny BERT classifier, built
from configs (no download), train bit-equal to the native PyTorch loop of the transformers docs,
the GPT-2 resumes exactly after a kill, and a checkpoint's weights go to ``save_pretrained``.

Run as a script, ``python test_transformers.py WORK_DIR KILL_AT``, it is the process that the
kill test kills: the GPT-2 run, SIGKILLed after iteration index ``KILL_AT``.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    get_scheduler,
)

from trainer import HookBase, Trainer  # noqa: E402

from conftest import communicate, cpu_env, failure_output, popen  # noqa: E402

EPOCHS = 2
ACCUMULATION = 2  # 8 batches an epoch: 4 optimizer steps
WARMUP = 2  # optimizer steps
SEED = 2  # dropout's draws, and the loader's shuffling, from here on in both loops

GPT2 = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
BERT = BertConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=16,
    num_labels=3,
)


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2)


def bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(BERT)


def gpt2_loader():
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": x, "labels": x} for x in ids]  # a causal LM shifts them itself
    return DataLoader(samples, batch_size=4, shuffle=True)


def bert_loader():
    g = torch.Generator().manual_seed(1)
    ids, labels = (
        torch.randint(0, 64, (32, 8), generator=g),
        torch.randint(0, 3, (32,), generator=g),
    )
    mask = torch.ones(32, 8, dtype=torch.long)
    samples = [
        {"input_ids": x, "attention_mask": m, "labels": y} for x, m, y in zip(ids, mask, labels)
    ]
    return DataLoader(samples, batch_size=4, shuffle=True)


def optimizer_and_schedule(model, loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = EPOCHS * len(loader) // ACCUMULATION
    schedule = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=WARMUP, num_training_steps=steps
    )
    return optimizer, schedule


def native_loop(model, loader):
    """The loop of the transformers docs' "Train in native PyTorch", with accumulation and
    clipping as their "Gradient accumulation" and Accelerate pages add them."""
    optimizer, lr_scheduler = optimizer_and_schedule(model, loader)
    torch.manual_seed(SEED)
    model.train()
    for _ in range(EPOCHS):
        for i, batch in enumerate(loader):
            outputs = model(**batch)
            loss = outputs.loss / ACCUMULATION
            loss.backward()
            if (i + 1) % ACCUMULATION == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    return model


def port(model, loader, work_dir):
    """The same run with the trainer: the model as it is, no wrapper."""
    optimizer, lr_scheduler = optimizer_and_schedule(model, loader)
    return Trainer(
        model,
        optimizer,
        lr_scheduler,
        loader,
        max_epochs=EPOCHS,
        work_dir=work_dir,
        unpack_batch_dict=True,
        accumulation_steps=ACCUMULATION,
        clip_grad_norm=1.0,
        by_epoch=False,  # the schedule counts optimizer steps
        log_period=2,
    )


def trained(model, loader, work_dir):
    trainer = port(model, loader, work_dir)
    torch.manual_seed(SEED)
    trainer.train()
    return trainer


def assert_bit_equal(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the fastest for models this small, where two spinning against another
    job on the machine made a step 80 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    return trained(gpt2(), gpt2_loader(), tmp_path_factory.mktemp("gpt2"))


def test_a_gpt2_trains_as_it_is_bit_equal_to_the_native_loop(gpt2_run):
    assert gpt2_run.cur_iter + 1 == EPOCHS * 4
    assert_bit_equal(gpt2_run.model, native_loop(gpt2(), gpt2_loader()))


def test_a_bert_classifier_trains_as_it_is_bit_equal_to_the_native_loop(tmp_path):
    trainer = trained(bert(), bert_loader(), tmp_path)
    assert_bit_equal(trainer.model, native_loop(bert(), bert_loader()))


def test_the_loss_is_logged_and_the_logits_are_not(gpt2_run):
    with open(os.path.join(gpt2_run.work_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert all("total_loss" in row for row in rows if "lr" in row)
    assert rows[-1]["total_loss"] > 0
    assert not any(name.startswith(("loss", "logits", "cache")) for row in rows for name in row)
    with open(gpt2_run.log_file) as f:
        log = f.read()
    assert " total_loss " in log and " loss " not in log and "logits" not in log


def test_a_checkpoint_loads_into_the_model_for_save_pretrained(gpt2_run, tmp_path):
    state = torch.load(gpt2_run.checkpointer.last_path, weights_only=True)["model"]
    model = GPT2LMHeadModel(GPT2)
    model.load_state_dict(state)  # strict: no key to rename or drop
    assert_bit_equal(model, gpt2_run.model)
    model.save_pretrained(tmp_path / "gpt2")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert_bit_equal(loaded, gpt2_run.model)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied, as they were


def test_an_output_without_loss_is_refused_naming_the_logits(tmp_path):
    trainer = port(gpt2(), gpt2_loader(), tmp_path)
    batch = next(iter(gpt2_loader()))
    del batch["labels"]  # the model then returns no loss
    with pytest.raises(ValueError, match=r"'logits'.* shape \(4, 8, 64\).*'loss'") as error:
        trainer.compute_losses(batch)
    assert "mean" not in str(error.value)


class KillAfter(HookBase):
    """SIGKILLs the process after iteration index ``it``, once its checkpoints are on disk."""

    def __init__(self, it):
        self.it = it

    def after_iter(self):
        if self.trainer.cur_iter == self.it:
            self.trainer.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_gpt2_resumes_exactly_after_a_kill(gpt2_run, tmp_path):
    work = tmp_path / "work"
    killed = popen(
        [sys.executable, __file__, str(work), "5"],  # in epoch 2, after epoch 1's checkpoint
        env=cpu_env(OMP_NUM_THREADS="1"),  # as here: the same kernels, the same bits
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = communicate(killed, timeout=120)
    assert killed.returncode == -signal.SIGKILL, failure_output(stderr)
    resumed = port(gpt2(), gpt2_loader(), work)
    resumed.train()  # auto_resume: from the checkpoint of epoch 1
    assert resumed.start_iter == 4
    assert_bit_equal(resumed.model, gpt2_run.model)


if __name__ == "__main__":
    trainer = port(gpt2(), gpt2_loader(), sys.argv[1])
    trainer.register_hook(KillAfter(int(sys.argv[2])))
    torch.manual_seed(SEED)
    trainer.train()
