"""CPD's DavidNet experiment: ResNet-9 (DavidNet), triangular LR over 24 epochs (peak 0.4 at
epoch 5, Nesterov), 8 workers with 8-bit (E5M2) gradients and APS.

  python examples/cpd_davidnet.py --data-dir ~/cifar          # 24 epochs
  python examples/cpd_davidnet.py --smoke
"""

from _common import base_parser, run


def main(argv=None):
  p = base_parser(__doc__.splitlines()[0])
  p.add_argument("--grad_exp", type=int, default=5)
  p.add_argument("--grad_man", type=int, default=2)
  p.add_argument("--use_APS", action="store_true", default=True)
  p.add_argument("--no_APS", dest="use_APS", action="store_false")
  p.add_argument("--lr_scale", type=float, default=1.0)
  a = p.parse_args(argv)
  p_lr = 0.4 * a.lr_scale
  return run(a, model="resnet9", nodes=8, grad_exp=a.grad_exp, grad_man=a.grad_man,
             aps=a.use_APS, epochs=24, batch_size=512, lr=p_lr, schedule="triangle",
             warmup_epochs=5, weight_decay=5e-4, width=64)


if __name__ == "__main__":
  main()
