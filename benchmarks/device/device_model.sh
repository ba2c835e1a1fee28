# Sourced by the device scripts that need the bundled model: the third of three back-to-back calls.
# The model travels as an xz stream cut in three (.model/z_00, z_01: 40,000,000 bytes each; z_02 the rest),
# because each call carries at most 64 MiB with the tracked tree (~21 MB) and the wheels:
#   call 1 carries .model/z_00, .model/SHA256 and .whl (the small wheels) and runs
#     mkdir -p /root/m /root/whl && cp .model/z_00 .model/SHA256 /root/m/ && cp .whl/* /root/whl/
#   call 2 carries .model/z_01 and .whl-big (llguidance, which the engine imports) and runs
#     cp .model/z_01 /root/m/ && cp .whl-big/*.whl /root/whl/
#   call 3 carries .model/z_02 (and what the run needs) and sources this file, which unpacks the stream to
#     $M and checks its sha256 (skipped once the model is there, i.e. on later calls to a warm machine).
# Here: `cat z_00 z_01 | split -b 40000000 -d -a 2 - .model/z_` re-cuts an older two-part copy.
M=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$M" ]; then
  cat /root/m/z_00 /root/m/z_01 .model/z_02 | python3 -c 'import lzma, sys, shutil; shutil.copyfileobj(
lzma.open(sys.stdin.buffer), open(sys.argv[1], "wb"))' "$M" || { echo "model unpack failed"; exit 3; }
fi
(cd /root/m && sha256sum -c SHA256) || { echo "model sha256 mismatch"; exit 3; }
