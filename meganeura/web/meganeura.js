// meganeura.js: run a meganeura bundle (docs/export.md, schema meganeura-bundle/1) in a web
// page through the browser's WebGPU. One ES module, no dependencies, no build step:
//
//   import { loadBundle } from "./meganeura.js";
//   const bundle = await loadBundle("bundle/");            // fetch, verify, build once
//   const out = await bundle.run({ x: new Float32Array(784) });
//   out.output;                                            // Float32Array, shape bundle.outputs.output.shape
//
// loadBundle fetches manifest.json, every kernel's WGSL and weights.safetensors (parsed here),
// checks each file's sha256 against the manifest, checks the adapter's features and limits
// against the manifest's `requires` (a BundleError naming what is missing), then creates the
// buffers, pipelines and bind groups once. run() checks the feeds (names, lengths, types,
// index ranges), uploads them, replays the dispatch list in one compute pass and reads every
// output back as a typed array of the output's host dtype (float32 -> Float32Array, int32 ->
// Int32Array, bool -> Uint8Array of 0/1).
//
// Browsers compile WGSL with Tint, which keeps bounds checks on (the bundles are exported to run
// with them) and requires `enable subgroups;` in kernels that use subgroup builtins, which
// naga rejects, so the exporter leaves it out and this module prepends it.

export const SCHEMA = "meganeura-bundle/1";

/** A bundle that cannot be loaded or run here: bad schema, a file whose hash differs, a
 * missing WebGPU feature or limit, a kernel the browser rejects, or a feed that does not match
 * an input. The message names the file, feature, limit, kernel or input. */
export class BundleError extends Error {
  constructor(message) {
    super(message);
    this.name = "BundleError";
  }
}

// The manifest's feature names are wgpu-py's; the browser's differ for subgroups.
const FEATURE = { subgroup: "subgroups", "shader-f16": "shader-f16" };
const STORAGE_BYTES = { float32: 4, int32: 4, uint32: 4, bool: 4, float16: 2 };
const SAFETENSORS = { F32: Float32Array, I32: Int32Array, U32: Uint32Array, F16: Uint16Array };
const HOST = { float32: Float32Array, int32: Int32Array, uint32: Uint32Array, bool: Uint8Array };

const camel = (name) => name.replace(/-([a-z])/g, (_, c) => c.toUpperCase());
const align4 = (n) => Math.ceil(n / 4) * 4;
const count = (shape) => shape.reduce((a, b) => a * b, 1);

/** Parse a safetensors file (https://huggingface.co/docs/safetensors): an 8-byte little-endian
 * header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.
 * Returns {name: {dtype, shape, bytes: Uint8Array}} (views into `buffer`, not copies). */
export function parseSafetensors(buffer, where = "safetensors") {
  const view = new DataView(buffer);
  const n = Number(view.getBigUint64(0, true));
  if (8 + n > buffer.byteLength) throw new BundleError(`${where}: header runs past the file`);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, n)));
  const body = 8 + n;
  const out = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const [start, end] = info.data_offsets;
    if (!(info.dtype in SAFETENSORS) || start < 0 || end < start || body + end > buffer.byteLength)
      throw new BundleError(`${where}: tensor ${name} is malformed`);
    out[name] = {
      dtype: info.dtype,
      shape: info.shape,
      bytes: new Uint8Array(buffer, body + start, end - start),
    };
  }
  return out;
}

// IEEE half <-> single, round to nearest even (for fast-precision bundles whose host-side
// float32 inputs or outputs the GPU stores as f16).
const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
function toHalf(x) {
  f32[0] = x;
  const b = u32[0];
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  let mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let h = mant >>> shift;
    const rem = mant & ((1 << shift) - 1);
    const half = 1 << (shift - 1);
    if (rem > half || (rem === half && h & 1)) h++;
    return sign | h;
  }
  let h = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && h & 1)) h++;
  return sign | h;
}
function fromHalf(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

async function sha256(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function fetchBytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new BundleError(`${url}: HTTP ${r.status} ${r.statusText}`);
  return r.arrayBuffer();
}

/** Check an adapter or device against the manifest's `requires`; throws a BundleError naming
 * the first feature or limit it lacks. */
export function checkRequirements(requires, gpu, what = "adapter") {
  for (const f of requires.features) {
    const name = FEATURE[f] ?? f;
    if (!gpu.features.has(name))
      throw new BundleError(
        `the bundle needs the WebGPU feature '${name}', which this ${what} lacks` +
          (name === "shader-f16" ? " (re-export with --strict for targets without it)" : "") +
          (name === "subgroups" ? " (re-export with target='web' for targets without it)" : ""),
      );
  }
  for (const [k, need] of Object.entries(requires.limits)) {
    const have = gpu.limits[camel(k)];
    if (have === undefined) continue;
    if (k === "min-storage-buffer-offset-alignment") {
      if (need % have)
        throw new BundleError(
          `the bundle binds at offsets that are multiples of ${need}; this ${what}'s ${k} is ${have}`,
        );
    } else if (have < need) {
      throw new BundleError(`the bundle needs ${k} >= ${need}; this ${what} allows ${have}`);
    }
  }
}

/** Request an adapter and a device with exactly the bundle's features and limits. */
export async function requestDevice(requires) {
  if (!globalThis.navigator?.gpu)
    throw new BundleError(
      "WebGPU is not available here (navigator.gpu is undefined): it needs a browser with " +
        "WebGPU and a secure context (https://, or http://127.0.0.1 / localhost)",
    );
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter)
    throw new BundleError(
      "navigator.gpu.requestAdapter() returned null: the browser has WebGPU but no adapter " +
        "(GPU blocklisted or disabled; headless Chromium needs --enable-unsafe-webgpu)",
    );
  checkRequirements(requires, adapter, "adapter");
  const requiredLimits = {};
  for (const [k, need] of Object.entries(requires.limits))
    if (k !== "min-storage-buffer-offset-alignment" && camel(k) in adapter.limits)
      requiredLimits[camel(k)] = need;
  return adapter.requestDevice({
    label: "meganeura bundle",
    requiredFeatures: requires.features.map((f) => FEATURE[f] ?? f),
    requiredLimits,
  });
}

/** Fetch, verify and build the bundle at `url` (a folder URL; relative to the page).
 * Options: {device} a GPUDevice to use (else one is requested), {verify: false} skips the
 * sha256 checks. Resolves to a Bundle. */
export async function loadBundle(url, { device = null, verify = true } = {}) {
  const base = new URL(url.endsWith("/") ? url : url + "/", location.href);
  const manifest = await (await fetch(new URL("manifest.json", base))).json();
  if (manifest.schema !== SCHEMA)
    throw new BundleError(`${base}: schema ${manifest.schema}, expected ${SCHEMA}`);
  const files = {};
  await Promise.all(
    Object.entries(manifest.files).map(async ([name, digest]) => {
      const bytes = await fetchBytes(new URL(name, base));
      if (verify) {
        const got = await sha256(bytes);
        if (got !== digest)
          throw new BundleError(
            `${base}${name} has sha256 ${got}, the manifest says ${digest} (changed or damaged)`,
          );
      }
      files[name] = bytes;
    }),
  );
  device = device ?? (await requestDevice(manifest.requires));
  checkRequirements(manifest.requires, device, "device");
  const bundle = new Bundle(manifest, files, device);
  await bundle._build();
  return bundle;
}

/** The GPU objects of one bundle and the step that replays it. `inputs` / `outputs`:
 * {name: {shape, dtype}} (host dtypes, NumPy names); `manifest`: the parsed manifest. */
export class Bundle {
  constructor(manifest, files, device) {
    this.manifest = manifest;
    this.device = device;
    this._files = files;
    this._errors = [];
    this.inputs = Object.fromEntries(
      manifest.inputs.map((s) => [s.name, { shape: s.shape, dtype: s.dtype }]),
    );
    this.outputs = Object.fromEntries(
      manifest.outputs.map((s) => [s.name, { shape: s.shape, dtype: s.dtype }]),
    );
    device.addEventListener?.("uncapturederror", (e) => this._errors.push(e.error.message));
    device.lost?.then((info) => this._errors.push(`device lost: ${info.reason} ${info.message}`));
  }

  async _build() {
    const m = this.manifest;
    const gpu = this.device;
    const U = GPUBufferUsage;
    this._buffers = m.buffers.map((b) =>
      gpu.createBuffer({
        label: `b${b.id} ${b.role}`,
        size: align4(Math.max(b.size, 4)),
        usage: U.STORAGE | U.COPY_SRC | U.COPY_DST,
      }),
    );
    // Weights: one host image per buffer (slots may be 2-aligned f16), written once.
    const tensors = parseSafetensors(this._files[m.weights.file], m.weights.file);
    const images = new Map();
    for (const t of m.weights.tensors) {
      const src = tensors[t.name];
      if (!src) throw new BundleError(`${m.weights.file}: tensor ${t.name} is missing`);
      const id = t.buffer;
      if (!images.has(id)) images.set(id, new Uint8Array(this._buffers[id].size));
      images.get(id).set(src.bytes, t.offset);
    }
    for (const [id, image] of images) gpu.queue.writeBuffer(this._buffers[id], 0, image);
    // Pipelines: one per distinct kernel and access pattern, compiled concurrently.
    const layouts = new Map();
    const pipelines = new Map();
    const pending = [];
    for (const d of m.dispatches) {
      const access = d.bindings.map((b) => b.access).join(",");
      if (!layouts.has(access)) {
        const bgl = gpu.createBindGroupLayout({
          entries: d.bindings.map((b, i) => ({
            binding: i,
            visibility: GPUShaderStage.COMPUTE,
            buffer: { type: b.access === "read_write" ? "storage" : "read-only-storage" },
          })),
        });
        layouts.set(access, [bgl, gpu.createPipelineLayout({ bindGroupLayouts: [bgl] })]);
      }
      const key = `${d.kernel}|${access}`;
      if (!pipelines.has(key)) {
        const k = m.kernels[d.kernel];
        let code = new TextDecoder().decode(this._files[k.file]);
        if (k.features.includes("subgroup") && !/\benable\s+subgroups\s*;/.test(code))
          code = "enable subgroups;\n" + code;
        const module = gpu.createShaderModule({ label: d.name, code });
        const p = gpu
          .createComputePipelineAsync({
            label: d.name,
            layout: layouts.get(access)[1],
            compute: { module, entryPoint: "main" },
          })
          .catch(async (e) => {
            const info = await module.getCompilationInfo();
            const msgs = info.messages
              .map((x) => `  ${x.type} at ${x.lineNum}:${x.linePos}: ${x.message}`)
              .join("\n");
            throw new BundleError(
              `kernel ${d.name} (${k.file}) failed to compile in this browser: ${e.message}\n${msgs}`,
            );
          });
        pipelines.set(key, p);
        pending.push(p);
      }
    }
    await Promise.all(pending);
    this._plan = [];
    for (const d of m.dispatches) {
      const access = d.bindings.map((b) => b.access).join(",");
      const bg = gpu.createBindGroup({
        label: d.name,
        layout: layouts.get(access)[0],
        entries: d.bindings.map((b, i) => ({
          binding: i,
          resource: { buffer: this._buffers[b.buffer], offset: b.offset, size: b.size },
        })),
      });
      if (!d.grid.includes(0))
        this._plan.push([await pipelines.get(`${d.kernel}|${access}`), bg, d.grid]);
    }
    this._inputs = Object.fromEntries(m.inputs.map((s) => [s.name, s]));
    this._staging = {};
    for (const s of m.outputs) {
      const [, length] = span(s);
      if (length)
        this._staging[s.name] = gpu.createBuffer({
          label: `read ${s.name}`,
          size: length,
          usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
        });
    }
    delete this._files;
    await gpu.queue.onSubmittedWorkDone();
    this._throwErrors("loading the bundle");
  }

  _throwErrors(when) {
    if (this._errors.length) {
      const errors = this._errors.splice(0);
      throw new BundleError(`WebGPU reported errors ${when}:\n  ${errors.join("\n  ")}`);
    }
  }

  _checked(name, value) {
    const s = this._inputs[name];
    const n = count(s.shape);
    const Host = HOST[s.dtype];
    if (!(ArrayBuffer.isView(value) || Array.isArray(value)))
      throw new BundleError(
        `input ${name}: expected a ${Host.name} (or array) of ${n} values, shape [${s.shape}]`,
      );
    if (ArrayBuffer.isView(value) && !(value instanceof Host))
      throw new BundleError(`input ${name}: expected a ${Host.name}, got ${value.constructor.name}`);
    if (value.length !== n)
      throw new BundleError(
        `input ${name}: expected ${n} values (shape [${s.shape}]), got ${value.length}`,
      );
    for (const lc of this.manifest.label_checks ?? []) {
      if (lc.name !== name) continue;
      for (const v of value)
        if ((v < 0 || v >= lc.num_classes) && v !== lc.ignore_index)
          throw new BundleError(`input ${name}: ${lc.what} ${v} is outside [0, ${lc.num_classes})`);
    }
    if (s.storage === "float16") return Uint16Array.from(value, toHalf);
    if (s.storage === "bool") return Uint32Array.from(value, (v) => (v ? 1 : 0));
    const Storage = { float32: Float32Array, int32: Int32Array, uint32: Uint32Array }[s.storage];
    return value instanceof Storage ? value : Storage.from(value);
  }

  async _write(s, data) {
    const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    if (!bytes.length) return;
    const [start, length] = span(s);
    const buffer = this._buffers[s.buffer];
    if (start === s.offset && length === bytes.length) {
      this.device.queue.writeBuffer(buffer, start, bytes);
      return;
    }
    // A slot that does not start or end on 4 bytes (f16): read the block, patch it, write it.
    const read = this.device.createBuffer({
      size: length,
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    });
    const enc = this.device.createCommandEncoder();
    enc.copyBufferToBuffer(buffer, start, read, 0, length);
    this.device.queue.submit([enc.finish()]);
    await read.mapAsync(GPUMapMode.READ);
    const block = new Uint8Array(read.getMappedRange()).slice();
    read.destroy();
    block.set(bytes, s.offset - start);
    this.device.queue.writeBuffer(buffer, start, block);
  }

  /** Upload `feeds` ({input name: typed array or array, row-major, of the input's length}),
   * run every dispatch and resolve to {output name: typed array} (host dtypes). Calls made
   * while one is in flight wait their turn (the buffers and read-back buffers are shared). */
  run(feeds) {
    const turn = (this._queue ?? Promise.resolve()).then(() => this._run(feeds));
    this._queue = turn.catch(() => {});
    return turn;
  }

  async _run(feeds) {
    const names = Object.keys(this._inputs);
    const missing = names.filter((n) => !(n in feeds));
    const unknown = Object.keys(feeds).filter((n) => !(n in this._inputs));
    if (missing.length || unknown.length)
      throw new BundleError(
        `feeds do not match the bundle's inputs: missing [${missing}], unknown [${unknown}] ` +
          `(inputs: [${names}])`,
      );
    const ready = names.map((n) => [this._inputs[n], this._checked(n, feeds[n])]);
    for (const [s, data] of ready) await this._write(s, data);
    const enc = this.device.createCommandEncoder();
    const pass = enc.beginComputePass();
    for (const [pipeline, bg, grid] of this._plan) {
      pass.setPipeline(pipeline);
      pass.setBindGroup(0, bg);
      pass.dispatchWorkgroups(grid[0], grid[1], grid[2]);
    }
    pass.end();
    for (const s of this.manifest.outputs) {
      const staging = this._staging[s.name];
      if (!staging) continue;
      const [start, length] = span(s);
      enc.copyBufferToBuffer(this._buffers[s.buffer], start, staging, 0, length);
    }
    this.device.queue.submit([enc.finish()]);
    const out = {};
    await Promise.all(
      this.manifest.outputs.map(async (s) => {
        const Host = HOST[s.dtype] ?? Float32Array;
        const n = count(s.shape);
        const staging = this._staging[s.name];
        if (!staging) {
          out[s.name] = new Host(n);
          return;
        }
        await staging.mapAsync(GPUMapMode.READ);
        const [start] = span(s);
        const raw = staging.getMappedRange().slice(0);
        staging.unmap();
        const head = s.offset - start;
        if (s.storage === "float16") {
          const h = new Uint16Array(raw, head, n);
          out[s.name] = Host.from(h, fromHalf);
        } else if (s.storage === "bool") {
          out[s.name] = Uint8Array.from(new Uint32Array(raw, head, n), (v) => (v ? 1 : 0));
        } else {
          const Storage = { float32: Float32Array, int32: Int32Array, uint32: Uint32Array }[
            s.storage
          ];
          const v = new Storage(raw, head, n);
          out[s.name] = v instanceof Host ? v : Host.from(v);
        }
      }),
    );
    this._throwErrors("running the bundle");
    return out;
  }

  /** Free the bundle's buffers (the device stays). */
  destroy() {
    for (const b of this._buffers) b.destroy();
    for (const b of Object.values(this._staging)) b.destroy();
  }
}

/** [4-aligned start, 4-aligned length] of a slot's bytes in its buffer. */
function span(s) {
  const n = count(s.shape) * STORAGE_BYTES[s.storage];
  const start = s.offset - (s.offset % 4);
  return [start, align4(s.offset + n) - start];
}

/** Index of the largest value (ties: the first). */
export function argmax(values, start = 0, end = values.length) {
  let best = start;
  for (let i = start + 1; i < end; i++) if (values[i] > values[best]) best = i;
  return best - start;
}

/** Softmax of values[start:end] as a Float64Array. */
export function softmax(values, start = 0, end = values.length) {
  let max = -Infinity;
  for (let i = start; i < end; i++) max = Math.max(max, values[i]);
  const out = new Float64Array(end - start);
  let sum = 0;
  for (let i = start; i < end; i++) sum += out[i - start] = Math.exp(values[i] - max);
  for (let i = 0; i < out.length; i++) out[i] /= sum;
  return out;
}
