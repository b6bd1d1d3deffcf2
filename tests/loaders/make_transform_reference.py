"""Prints the reference values test_transforms.cpp checks ferry's resize and crop against.

Computed independently with PyTorch (Debian's python3-torch 1.13), the way torchvision resizes a
uint8 tensor with antialias=False: interpolate(mode="bilinear", align_corners=False) in float,
then round to the nearest integer. Run: /usr/bin/python3 tests/loaders/make_transform_reference.py
"""
import torch
import torch.nn.functional as F

H, W, C = 4, 6, 3
img = torch.tensor([[[(y * 37 + x * 11 + c * 5 * y + c * 3) % 256 for c in range(C)] for x in range(W)] for y in range(H)],
                   dtype=torch.uint8)  # HWC


def resize(hwc, h, w):
    chw = hwc.permute(2, 0, 1).unsqueeze(0).float()
    out = F.interpolate(chw, size=(h, w), mode="bilinear", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0)


def emit(name, t):
    vals = ", ".join(str(int(v)) for v in t.flatten().tolist())
    print(f"// {name}: {list(t.shape)}\nconst std::vector<int> {name} = {{{vals}}};")


emit("kInput", img)
emit("kResize3x4", resize(img, 3, 4))
emit("kResize7x9", resize(img, 7, 9))
emit("kCenterCrop2x3", img[1:3, 2:5])                  # round((4-2)/2) = 1, round((6-3)/2) = round(1.5) = 2
emit("kCropResize", resize(img[1:4, 1:5], 5, 5))       # crop top 1, left 1, 3x4, then resize to 5x5
emit("kResizeCrop", resize(img, 8, 10)[2:5, 3:7])      # resize 8x10, center_crop 3x4: top round(2.5) = 2, left 3
flip = resize(img, 5, 7).flip(1)
emit("kResizeFlip", flip)
