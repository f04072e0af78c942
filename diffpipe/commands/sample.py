"""`diffpipe sample`: images from a finished run's weights, one per seed.

    diffpipe sample runs/digits --prompt "a handwritten digit seven" --num 8 --seed 0 --steps 30 --out seven.png [--force]
    diffpipe sample runs/flux_kontext_tiny --prompt "a photo of the chinese temple" --control grey.png --out colour.png
"""
from __future__ import annotations

from pathlib import Path

from ..errors import CommandError

__all__ = ["sample_command"]

def sample_command(args) -> None:
    """Images (or clips) from a finished run, enlarged when tiny."""
    from ..grids import enlargement, save_grid
    from ..sampling import finished_run_config, load_generator
    from ..written_files import check_target, is_image

    for name, value in (("--num", args.num), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise CommandError(f"{name} {value}: give 1 or more")
    # before any work: --out's name, what the run folder lacks, then whether --out may be written
    _check_image_name(Path(args.out))
    finished_run_config(Path(args.run_dir))
    check_target(Path(args.out), args.force, is_image, "an image file", [("the run folder", Path(args.run_dir))])
    if args.control is not None and not Path(args.control).is_file():
        raise CommandError(f"--control {args.control} is not a file; give the image to edit (or a first frame)")
    gen = load_generator(args.run_dir)
    family = gen.feed.family
    if args.control is not None and not (family.reads_control or family.reads_first_frame):
        raise CommandError(f"--control gives an edit model the image to edit (an image-to-video model its first "
                           f"frame), and {args.run_dir} trained {gen.config.model.architecture!r}, which reads "
                           "none: leave --control out")
    steps = gen.config.sample.steps if args.steps is None else args.steps
    guidance = gen.config.sample.guidance_scale if args.guidance is None else args.guidance
    seeds = [args.seed + i for i in range(args.num)]
    controls = [Path(args.control)] * args.num if args.control is not None else None
    images = gen.generate([args.prompt] * args.num, seeds, steps, guidance, controls=controls)
    if images.dim() == 5:  # clips are written beside --out as .gif (grids.save_grid): that file obeys the rule too
        check_target(Path(args.out).with_suffix(".gif"), args.force, is_image, "an image file",
                     [("the run folder", Path(args.run_dir))])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    scale = enlargement(images.shape[-2])  # tiny images (8x8 digits) enlarged to be seen when opened
    written = save_grid(images, 1, args.out)  # the user's own picture: unlabelled
    print(f"wrote {args.num} image(s) to {written}" + (f", each enlarged {scale}x" if scale > 1 else ""))


def _check_image_name(out: Path) -> None:
    """--out names an image file PIL can write."""
    from PIL import Image

    writable = {ext for ext, name in Image.registered_extensions().items() if name in Image.SAVE}
    if out.suffix.lower() not in writable:
        raise CommandError(f"--out {out}: give an image file name (.png, .jpg, .webp; clips are written as .gif)")
    if out.is_dir():
        raise CommandError(f"--out {out} is a folder; give an image file name such as {out / 'samples.png'}")
