"""CPD's DavidNet-style fast CIFAR-10 run with 8-bit (E5M2) gradients and APS.

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
  a = p.parse_args(argv)
  return run(a, model="resnet18", nodes=8, grad_exp=a.grad_exp, grad_man=a.grad_man,
             aps=a.use_APS, epochs=24, batch_size=512, lr=0.4, weight_decay=5e-4, width=32)


if __name__ == "__main__":
  main()
