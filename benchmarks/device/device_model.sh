# Sourced by the device scripts that need the bundled model: the second of two back-to-back calls.
# Call 1 carried .model/z_00, .model/SHA256 and .whl and ran
#   mkdir -p /root/m /root/whl && cp .model/z_00 .model/SHA256 /root/m/ && cp .whl/*.whl /root/whl/
# Call 2 carries .model/z_01 and sources this file, which unpacks the xz stream z_00 + z_01 to $M and checks
# its sha256 (the unpacking is skipped if the model is already there, i.e. on later calls to a warm machine).
M=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$M" ]; then
  cat /root/m/z_00 .model/z_01 | python3 -c 'import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer),
open(sys.argv[1], "wb"))' "$M" || { echo "model unpack failed"; exit 3; }
fi
(cd /root/m && sha256sum -c SHA256) || { echo "model sha256 mismatch"; exit 3; }
