"""Bring your own model and data: each script, with only its data and model sections replaced by a small
image classifier (as a user following the README would), trains, checkpoints, resumes, and, where nothing
per-process is in the model, reaches single_gpu.py's weights. A ResNet-shaped model trains in each after the
README's adaptation; without it, fsdp.py says what it shards and pipeline.py refuses it in one line."""

import re

import pytest

from conftest import (DISTRIBUTED, FP32, PARAM_ATOL, ROOT, SCRIPTS, WARNING, checkpoint_name, import_script, load,
                      max_param_diff, run, scalars)

# The replacement sections, written once for every script. Everything the scripts' main() needs from them:
# add_data_args, build_datasets, make_loader, add_model_args, build_model, loss_fn, count_correct and throughput_unit.
DATA = '''

def add_data_args(parser):
    parser.add_argument("--images", type=int, default=2048, help="synthetic images to generate")
    parser.add_argument("--classes", type=int, default=4, help="patterns an image may hold: one class each")


class PatternImages(Dataset):
    """Noise images, each with one of a few fixed 3x3 patterns added at a random place; the label says
    which. A convolution with a max over positions can find the pattern wherever it is."""

    def __init__(self, num_images, num_classes, size=12, seed=1234):
        gen = torch.Generator().manual_seed(seed)
        patterns = 2 * torch.randn(num_classes, 3, 3, generator=gen)
        self.labels = torch.randint(0, num_classes, (num_images,), generator=gen)
        self.images = torch.randn(num_images, 1, size, size, generator=gen)
        rows, cols = torch.randint(0, size - 2, (2, num_images), generator=gen).tolist()
        for i, (label, row, col) in enumerate(zip(self.labels.tolist(), rows, cols)):
            self.images[i, 0, row:row + 3, col:col + 3] += patterns[label]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def build_datasets(args):
    dataset = PatternImages(args.images, args.classes)
    log.info(f"{len(dataset)} images of 12x12 pixels in {args.classes} classes: guessing scores {1 / args.classes:.2f}")
    num_train = len(dataset) - len(dataset) // 10
    train_set, val_set = Subset(dataset, range(num_train)), Subset(dataset, range(num_train, len(dataset)))
    return train_set, val_set, {"num_classes": args.classes}


def make_loader(dataset, batch_size, args, **options):
    return DataLoader(dataset, batch_size, **options)  # images already in memory: the training process fetches them


'''

# The model section's functions for a classifier of the images, whichever network it is.
CLASSIFIED = '''

def loss_fn(logits, labels, reduction="mean"):
    return F.cross_entropy(logits, labels, reduction=reduction)


def count_correct(logits, labels):
    return (logits.argmax(-1) == labels).sum(), labels.numel()


def throughput_unit(model, args):
    """Images, one per sample; their FLOPs are left to torch to count (None)."""
    return "images", 1, None



'''

MODEL = '''

def add_model_args(parser):
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout before the head (0: none)")


class ConvNet(nn.Module):
    def __init__(self, num_classes, width, dropout):
        super().__init__()
        # The repeated layers in a container named blocks, as in the GPT: fsdp.py shards each block alone, and
        # pipeline.py gives each stage some of them.
        self.blocks = nn.ModuleDict({
            "0": nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU()),
            "1": nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU()),
        })
        self.pool = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Dropout(dropout))
        self.head = nn.Linear(2 * width, num_classes)

    # forward() in the GPT's three parts, for pipeline.py: nothing comes before the blocks here.
    def forward(self, images):
        x = self.embed(images)
        for block in self.blocks.values():
            x = block(x)
        return self.output(x)

    def embed(self, images):
        return images

    def output(self, x):
        return self.head(self.pool(x))


def build_model(args, data_info):
    if not 0 <= args.dropout < 1:
        fail(f"--dropout must be at least 0 and below 1, got {args.dropout}")
    config = {"num_classes": data_info["num_classes"], "width": args.width, "dropout": args.dropout}
    return ConvNet(**config), config


''' + CLASSIFIED

SECTION = re.compile(r"^# -- (\w[\w ]*\w) -+$", re.MULTILINE)
STEPS = 40
FLAGS = ["--batch-size", 32, "--grad-accum", 2, "--lr", 2e-2, "--warmup-steps", 4, "--log-every", 10,
         "--eval-every", 20, "--ckpt-every", 20, "--seed", 3]
CHANCE = 0.25  # 4 classes
MARGIN = 0.35  # held-out accuracy must reach 0.60. Measured: 0.745 in every script; the ResNet 0.765 alone, 0.80 on 2 processes


def with_classifier(script, directory, model=MODEL):
    """`script` as a user leaves it after replacing its data and model sections: everything else is untouched."""
    text = (ROOT / script).read_text()
    marks = {m.group(1): m for m in SECTION.finditer(text)}
    start, end = marks["data"].end(), marks["setup"].start()
    assert text[marks["model"].start():marks["model"].end()].startswith("# -- model")
    replaced = text[:start] + DATA + text[marks["model"].start():marks["model"].end()] + model + text[end:]
    path = directory / script
    path.write_text(replaced)
    return path


def train(path, tmp_path, *flags, steps=STEPS, tag="run"):
    result = run(path, *FLAGS, *flags, "--max-steps", steps, "--log-dir", tmp_path / f"tb-{tag}")
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    return result, scalars(tmp_path / f"tb-{tag}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_classifier_trains_checkpoints_resumes_and_matches_single_gpu(script, reference, tmp_path):
    path = with_classifier(script, tmp_path)
    ckpt_dir = tmp_path / "ckpt"
    first, first_tb = train(path, tmp_path, "--ckpt-dir", ckpt_dir, "--lr-decay-steps", STEPS, steps=STEPS // 2, tag="first")
    assert "images of 12x12 pixels in 4 classes" in first.output and first.output.count("val accuracy") == 2
    second, tb = train(path, tmp_path, "--ckpt-dir", ckpt_dir, tag="second")
    assert f"resumed from {ckpt_dir / checkpoint_name(script)} at step {STEPS // 2}" in second.output
    print(f"{script}: held-out accuracy {tb['val/accuracy'][STEPS]:.3f} after {STEPS} steps (chance {CHANCE})")
    assert tb["val/accuracy"][STEPS] >= CHANCE + MARGIN, tb["val/accuracy"]

    # The validation loss is a mean over images: the untrained model's is near a uniform guess's, ln 4 = 1.386.
    assert first_tb["val/loss"][0] == pytest.approx(1.386, abs=0.15), first_tb["val/loss"]
    assert tb["val/loss"][STEPS] < first_tb["val/loss"][0] - 0.5, (first_tb["val/loss"], tb["val/loss"])

    # The throughput is the model section's unit, images, and its FLOPs torch's count: each weight of a
    # convolution meets every output position, 12x12 for the first (16 x 9 weights), 6x6 for the second (stride 2,
    # 32 x 16 x 9), and the head's 4 x 32 weights once. A use is 2 FLOPs forward and 2 for the weight's gradient,
    # and 2 more for the input's gradient, which the first convolution does not compute (the images need none).
    flops = 2 * 144 * 144 * 2 + 2 * 36 * 4608 * 3 + 2 * 128 * 3
    assert f"torch's FlopCounterMode counts {flops:,} training FLOPs for each of the images" in second.output
    assert re.search(r"\d images/s, [\d.e+-]+ TFLOP/s \| ", second.output), second.output
    world_size = 2 if script in DISTRIBUTED else 1
    images_per_sec, tflops = tb["train/images_per_sec"], tb["train/tflops_per_process"]
    assert images_per_sec.keys() == tflops.keys()
    for step, value in tflops.items():
        assert value * 1e12 == pytest.approx(images_per_sec[step] * flops / world_size, rel=1e-5)

    ckpt = load(ckpt_dir)
    assert ckpt["config"] == {"num_classes": 4, "width": 16, "dropout": 0.0}
    assert ckpt["step"] == STEPS
    difference = max_param_diff(ckpt["model"], reference["convnet"])
    print(f"{script}: largest difference from single_gpu.py's weights {difference:.2g}")
    if script in FP32:  # ddp_amp.py's 16-bit forward rounds differently: its accuracy above is the test
        assert difference <= PARAM_ATOL


# A stand-in for a torchvision ResNet, with its layout and names (torchvision is no dependency of ours): a stem, four
# layers of residual blocks with BatchNorm, each layer but the first halving the image, average pooling, and a head
# that forward() reaches through torch.flatten. Scaled to 12x12 images: a 3x3 first convolution, a pooling of stride 1.
RESNET = '''

def add_model_args(parser):
    parser.add_argument("--width", type=int, default=8, help="channels of the first layer, doubled by each next")


class BasicBlock(nn.Module):
    def __init__(self, channels_in, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + identity)


class ResNet(nn.Module):
    def __init__(self, num_classes, width):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=1, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2))
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2))
        self.layer4 = nn.Sequential(BasicBlock(4 * width, 8 * width, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(args, data_info):
    config = {"num_classes": data_info["num_classes"], "width": args.width}
    return WRAPPED, config


''' + CLASSIFIED
# The README's adaptation, as a user copies it.
ADAPTATION = re.search(r"```python\n(class ResNetInPieces\(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
ADAPTED = RESNET.replace("WRAPPED", "ResNetInPieces(ResNet(**config))") + ADAPTATION + "\n\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """single_gpu.py's weights: with the classifier at the end of an uninterrupted run, with the ResNet half-way (the
    schedule set for the whole run)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    weights = {}
    for name, model, flags in [("convnet", MODEL, []), ("resnet", ADAPTED, ["--lr-decay-steps", STEPS])]:
        (tmp_path / name).mkdir()
        train(with_classifier("single_gpu.py", tmp_path / name, model), tmp_path, "--ckpt-dir", tmp_path / name / "ckpt",
              *flags, steps=STEPS // 2 if flags else STEPS, tag=name)
        weights[name] = load(tmp_path / name / "ckpt")["model"]
    return weights


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resnet_with_batch_norm_trains_after_the_readmes_adaptation(script, reference, tmp_path):
    """BatchNorm normalises with the statistics of each forward pass's own samples: 16 in single_gpu.py (2
    micro-batches of the global 32), 8 in each process of the DDP and FSDP scripts (2 processes x 2), so their
    weights move away from single_gpu.py's while training works as well. dataparallel.py on a CPU is single_gpu.py,
    and pipeline.py's stages normalise single_gpu.py's micro-batches. The weights are compared half-way: past it,
    BatchNorm, ReLU and max pooling can grow fp32's rounding (pipeline.py's gradients are summed, then divided by the
    micro-batches) into a real difference (seen on one CPU at step 40: 2.7e-3; at step 20: 9.2e-7)."""
    path = with_classifier(script, tmp_path, ADAPTED)
    first, first_tb = train(path, tmp_path, "--ckpt-dir", tmp_path / "ckpt", "--lr-decay-steps", STEPS, steps=STEPS // 2,
                            tag="first")
    weights = load(tmp_path / "ckpt")["model"]
    result, tb = train(path, tmp_path, "--ckpt-dir", tmp_path / "ckpt")
    print(f"{script}, ResNet: held-out accuracy {tb['val/accuracy'][STEPS]:.3f}")
    assert tb["val/accuracy"][STEPS] >= CHANCE + MARGIN, tb["val/accuracy"]
    assert tb["val/loss"][STEPS] < first_tb["val/loss"][0] - 0.5, (first_tb["val/loss"], tb["val/loss"])
    if script == "fsdp.py":
        assert "no blocks" not in result.output
    if script == "pipeline.py":  # split between residual blocks, the stem on the first stage, the head on the last
        assert "stage 0 (rank 0): stem, blocks.0, blocks.1\n" in first.output, first.output
        assert "stage 1 (rank 1): blocks.2, blocks.3, head\n" in first.output, first.output
    assert "stem.1.running_mean" in weights, list(weights)
    # Relative to a tensor's largest value where it exceeds 1: BatchNorm's running variances reach 34 here, where
    # fp32's values are 4e-6 apart (pipeline.py's differ by 2 of those steps, its weights by 2.4e-7).
    ref = reference["resnet"]
    difference = max(((weights[name] - ref[name]).abs().max() / ref[name].abs().max().clamp(min=1)).item() for name in ref)
    print(f"{script}, ResNet: largest difference from single_gpu.py's weights and buffers at step {STEPS // 2}: "
          f"{difference:.2g}")
    if script in ("ddp_spawn.py", "ddp_torchrun.py", "ddp_amp.py", "fsdp.py"):
        assert difference > 100 * PARAM_ATOL
    else:
        assert difference <= PARAM_ATOL


def test_fsdp_says_what_it_shards_of_a_model_without_blocks(tmp_path):
    path = with_classifier("fsdp.py", tmp_path, RESNET.replace("WRAPPED", "ResNet(**config)"))
    result, _tb = train(path, tmp_path, "--compile", steps=4)
    parameters = sum(p.numel() for p in import_script(str(path)).ResNet(4, 8).parameters())
    line = (f"the model has no blocks: FSDP shards it as one unit, which every rank gathers whole "
            f"({parameters * 4 / 2**20:,.1f} MiB) for each forward and backward: a ModuleList or ModuleDict "
            f"named blocks would be sharded block by block "
            f"| --compile compiles each block: nothing compiled\n")
    assert line in result.output, result.output


@pytest.mark.parametrize("change, message", [
    # torchvision's ResNet as it is: no pieces
    ("ResNet(**config)", ("pipeline.py runs a model as embed(), the modules of a ModuleDict named blocks, then output(): "
                         "ResNet lacks some of them")),
    # a forward() that does more than the pieces: here, a dropout only it runs
    ("Dropped(ResNet(**config))", ("forward() does not run as embed(), the blocks in order, then output(): "
                                  "pipeline.py, which runs those, would train another model")),
    # the head registered before the blocks: the first stage would keep it, the last would lack it
    ("HeadFirst(ResNet(**config))", ("embed() must run only modules registered before blocks, output() only those "
                                    "after: the first stage holds the former, the last the latter")),
])
def test_pipeline_refuses_a_model_whose_pieces_are_not_its_forward(change, message, tmp_path):
    variants = '''
class Dropped(ResNetInPieces):
    def __init__(self, resnet):
        super().__init__(resnet)
        self.dropout = nn.Dropout(0.1)

    def forward(self, images):
        return self.dropout(super().forward(images))


class HeadFirst(ResNetInPieces):
    def __init__(self, resnet):
        head = nn.Sequential(resnet.avgpool, nn.Flatten(), resnet.fc)
        super().__init__(resnet)
        del self.head, self.blocks
        self.head = head
        self.blocks = nn.ModuleDict({str(i): block for i, block in enumerate(
            block for layer in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4) for block in layer)})


'''
    path = with_classifier("pipeline.py", tmp_path, RESNET.replace("WRAPPED", change) + ADAPTATION + variants)
    result = run(path, *FLAGS, "--max-steps", 4, "--log-dir", tmp_path / "tb")
    assert result.returncode != 0
    errors = [line for line in result.output.splitlines() if line.startswith("pipeline.py: error: ")]
    assert f"pipeline.py: error: {message}" in errors, result.output
    assert 'pipeline.py", line' not in result.output, result.output  # no traceback of the script's own
