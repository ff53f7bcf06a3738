"""Shared flag handling for the example scripts (thin wrappers over ``jaxlp.training``)."""

from __future__ import annotations

import argparse

from jaxlp.training import TrainConfig, train


def base_parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--data-dir", default=None,
                 help="CIFAR-10 python batches; without it the built-in digits data is used")
  p.add_argument("--epochs", type=int, default=None)
  p.add_argument("--batch-size", type=int, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  p.add_argument("--smoke", action="store_true", help="CI-sized run on built-in data")
  return p


def run(args, **cfg_kwargs) -> list[dict]:
  """Train with CIFAR-10 when --data-dir is given, else digits; --smoke shrinks everything."""
  cfg = TrainConfig(**cfg_kwargs)
  cfg.seed = args.seed
  cfg.out = args.out
  if args.data_dir:
    cfg.data, cfg.data_dir = "cifar10", args.data_dir
  else:
    cfg.data = "digits"
  if args.epochs is not None:
    cfg.epochs = args.epochs
  if args.batch_size is not None:
    cfg.batch_size = args.batch_size
  if args.smoke:
    # CI-sized: the small CNN stands in for ResNet-18/VGG-19 (their full topologies are
    # trained in tests/flax_integration and by `jaxlp train --model ...`); everything else
    # as configured.
    cfg.model = "cnn" if cfg.model in ("resnet9", "resnet18", "vgg19") else cfg.model
    cfg.epochs, cfg.max_steps_per_epoch, cfg.width = 1, 2, 4
    cfg.warmup_epochs = min(cfg.warmup_epochs, cfg.epochs)
    cfg.batch_size = max(cfg.nodes * 2, 16)
    cfg.data, cfg.data_dir = "digits", None
  return train(cfg)
