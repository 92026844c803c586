"""cffi API-mode binding to libnftables, the nftables project's own library.

Only the JSON entry points are bound: rules are built as Python objects and
serialised with json.dumps, never as nft text.  One nft_ctx lives as long as
its owner (netd or a starter) and is used from one thread at a time.
"""
import cffi

ffibuilder = cffi.FFI()
ffibuilder.cdef(
    """
    struct nft_ctx;
    #define NFT_CTX_DEFAULT ...
    #define NFT_CTX_OUTPUT_JSON ...
    #define NFT_CTX_OUTPUT_HANDLE ...
    #define NFT_CTX_OUTPUT_ECHO ...
    struct nft_ctx *nft_ctx_new(uint32_t flags);
    void nft_ctx_free(struct nft_ctx *ctx);
    unsigned int nft_ctx_output_get_flags(struct nft_ctx *ctx);
    void nft_ctx_output_set_flags(struct nft_ctx *ctx, unsigned int flags);
    int nft_ctx_buffer_output(struct nft_ctx *ctx);
    const char *nft_ctx_get_output_buffer(struct nft_ctx *ctx);
    int nft_ctx_buffer_error(struct nft_ctx *ctx);
    const char *nft_ctx_get_error_buffer(struct nft_ctx *ctx);
    int nft_run_cmd_from_buffer(struct nft_ctx *nft, const char *buf);
    """
)
ffibuilder.set_source(
    "starter._nft",
    "#include <nftables/libnftables.h>",
    libraries=["nftables"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
