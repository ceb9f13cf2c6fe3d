"""Every error vpaged raises, in one place. Each also derives from the built-in exception a caller would
naturally catch (MemoryError for exhausted pages, IndexError for a bad layer, ...)."""


class VPagedError(Exception):
    """Base class of all vpaged errors."""


class OutOfPagesError(VPagedError, MemoryError):
    """The page pool has too few free pages; the call that raised changed nothing."""


class MappingLimitError(VPagedError, OSError):
    """The host refused another memory mapping (vm.max_map_count); nothing was changed."""


class AddressSpaceError(MappingLimitError):
    """The process cannot reserve the virtual address space asked for; the message says how much it can."""


class MappingLimitWarning(UserWarning):
    """A cache whose worst case (every sequence sharing pages) could exceed vm.max_map_count."""


class BackendError(VPagedError, RuntimeError):
    """An OS or driver call failed; the message names the call and the reason."""


class BackendUnavailableError(BackendError):
    """The requested backend cannot be used here (no driver, no device, built without CUDA)."""


class InvalidArgumentError(VPagedError, ValueError):
    """A bad argument reached the core (page index, page id, view outside mapped memory, ...)."""


class UnknownSequenceError(VPagedError, LookupError):
    """The sequence id was never allocated or has been freed."""


class SequenceTooLongError(VPagedError, ValueError):
    """Extending would take a sequence past the cache's max_seq_len."""


class SlotsExhaustedError(VPagedError, RuntimeError):
    """All max_seqs sequence slots are in use."""


class LayerIndexError(VPagedError, IndexError):
    """Layer index outside 0..num_layers-1."""


class CacheClosedError(VPagedError, RuntimeError):
    """The cache was closed; it holds no memory any more."""


class ViewsAliveError(VPagedError, RuntimeError):
    """Memory cannot be unmapped while tensor views of it are alive."""


class DTypeError(VPagedError, TypeError):
    """A tensor or cache dtype vpaged does not support, or one that does not match the cache."""


class ShapeError(VPagedError, ValueError):
    """A tensor whose shape does not match what the call expects."""


class SwapSpaceFullError(VPagedError, MemoryError):
    """The swap space has too few free chunks for the pages to swap out; nothing was changed."""


class SequenceSwappedError(VPagedError, RuntimeError):
    """The sequence is swapped out: swap_in() it (or free it) first."""


class ReadOnlyTokensError(VPagedError, ValueError):
    """A write to tokens outside the sequence's writable window (they may share pages with others)."""


class PromptTooLongError(VPagedError, ValueError):
    """A prompt longer than the model (max_model_len) or the KV budget allows; only that request is refused."""


class UnknownRequestError(VPagedError, LookupError):
    """No request with this id is known to the engine (never added, or already finished)."""


class TraceError(InvalidArgumentError):
    """A trace file or trace argument that cannot be used (`vpaged simulate`); the message names the row and
    the problem."""


class RequestError(InvalidArgumentError):
    """A request the server refuses (HTTP 400): `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFoundError(RequestError):
    """A request names a model that a server of several models does not serve (HTTP 404, code
    model_not_found, as OpenAI answers)."""


class EngineStepError(VPagedError, RuntimeError):
    """engine.step() raised inside the server's engine loop: the requests in flight were ended; the message
    carries the cause."""


class TensorParallelError(EngineStepError):
    """A tensor-parallel engine lost a rank (it died, raised, or a collective timed out): the message names
    the rank and the cause. The engine cannot go on; close it and start a new one (the server answers 503 and
    exits non-zero)."""


class BudgetError(VPagedError, RuntimeError):
    """A machine-wide shared budget (vpaged.memory.SharedBudget) that cannot be used as asked; the message
    names the budget and the fix."""


class BudgetNotFoundError(BudgetError, FileNotFoundError):
    """No shared budget of this name exists: create it first (`vpaged budget create NAME --bytes N`)."""


class BudgetExistsError(BudgetError, FileExistsError):
    """A shared budget of this name already exists: open it, or remove it (`vpaged budget remove NAME`)."""


class BudgetCorruptError(BudgetError):
    """The budget's segment is damaged or was made by another vpaged version (bad magic, version, size or
    checksum): nothing was read from it; remove it (`vpaged budget remove NAME`) and create it again."""


class BudgetPermissionError(BudgetError, PermissionError):
    """The budget's segment belongs to another user, or its mode lets other users read or write it: it is
    refused (a budget is private to its owner, 0600, unless created for a group with mode 0660)."""


class BudgetMismatchError(BudgetError, ValueError):
    """Joining a budget was refused up front: another page size, a min_bytes the budget cannot guarantee (the
    members' minimums would exceed its capacity, or the member's own ceiling), or no free member slot."""


class EngineUnavailableError(EngineStepError):
    """The server's engine loop of a model takes no more commands: its thread died (the message names the
    model and the cause) or it stopped (the server is shutting down). HTTP 503 at once, never a wait."""


class BudgetInUseError(BudgetError):
    """`remove` of a shared budget that live members still use: refused unless forced (`--force`)."""


class BudgetContentionError(BudgetError):
    """A change to a shared budget's ledger could not land in time (every try found another change landed
    first): nothing was changed; try again."""


class NoAllowedTokenError(InvalidArgumentError):
    """A request's constraints leave no token to generate: its grammar allows none of the model's vocabulary,
    or its bad_words / min_tokens ban every token the grammar allows (HTTP 400, code NoAllowedTokenError). Found
    when the request is added for its first token; found later, the request ends with finish_reason "error"."""


class BenchmarkScriptError(InvalidArgumentError):
    """The benchmark scripts `vpaged bench` and docs/numbers.md read results with cannot be used: no benchmarks
    folder, a script missing, one without a `summary_rows(results)` function, or rows that are not the summary
    row fields; the message names the folder or the script."""


class StoreError(VPagedError, RuntimeError):
    """Base class of the errors of a content-addressed KV page store (vpaged.memory.store.PageStore)."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No page store under that name or directory (open it with create=True to make one)."""


class StoreCorruptError(StoreError):
    """A page store's files are damaged: truncated (also while in use), overwritten, a bad magic or checksum,
    or a page whose bytes fail their checksum. Nothing of it was trusted; remove the store and create it again."""


class StoreMismatchError(StoreError, ValueError):
    """A page store that is not the one asked for: another format version, another page size or capacity than
    the caller gave, or a data file of another store beside the index."""


class StorePermissionError(StoreError, PermissionError):
    """A page store's files belong to another user (and are not shared with this one's group, mode 0660), or
    other users may read or write them: refused."""


class StoreFullError(StoreError, MemoryError):
    """A publish found no free slot and no page to evict (every published page is pinned or being written),
    or no space for the page's bytes: nothing was published."""


class StoreLeaseLostError(StoreError):
    """This process lost its client record in a page store (its lease ran out while it was stopped, and the
    others dropped its pins): its pinned handles are no longer valid; close the store and open it again."""


class VersionUnsupportedError(VPagedError, RuntimeError):
    """An integration was asked to run on a version of the other library it was not built and tested for (the
    vLLM connector on another vLLM than vpaged.integrations.vllm.SUPPORTED_VLLM_VERSIONS)."""
